"""``adadiag-ref reproduce``: AdamW against the AdaDiag family on two small CPU tasks.

Modules: ``data`` (stdlib-source characters, sklearn digits), ``model`` (LLaMA-style character model, CNN),
``schedule`` (10% warmup, cosine to 10%), ``train`` (one run; the tuned comparison), ``metrics`` (steps to a
target loss, speed-up), ``plot`` and ``cli``.
"""
