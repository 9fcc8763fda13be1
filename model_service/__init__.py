"""Model service: model, attention backends, engine loop, scheduler, sampler, servicer."""
