"""The values the model service's options take, named once: config.py validates its flags
against them, and the parts that act on them (model/loader.py, attention/select.py,
kernels/gemm.py) refuse anything else with the same lists. No imports: the command line reads
them without loading torch."""

DTYPES = ("float32", "bfloat16", "float16")                  # besides "auto"
KV_CACHE_DTYPES = DTYPES                                     # besides "auto"; which pairs run: dtype_choice.py
ATTENTION_BACKENDS = ("torch", "cpu", "flash_attn")          # besides "auto"
CPU_GEMMS = ("onednn", "native", "torch")                    # besides "auto" (its order: kernels/gemm.py)
PREEMPTION_MODES = ("recompute", "swap")
SPECULATIVE = ("off", "ngram")                               # speculative decoding's drafter
