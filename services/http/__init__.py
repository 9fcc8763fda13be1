"""The OpenAI-compatible HTTP front: /v1/completions, /v1/chat/completions, /v1/models, /health,
translated to kvserve.inference.v1.Inference on the server it stands beside."""
