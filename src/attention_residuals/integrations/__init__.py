"""Floor 5: AttnRes inside other libraries' models.

``patch``: :func:`apply_attnres` rewires the decoder layers of an existing model (a ``transformers``
Llama, Qwen2, GPT-2...) to AttnRes in place. ``hf``: the bundled GPT as a ``transformers``
``PreTrainedModel`` and the ``attnres export-hf`` command (needs the ``[hf]`` extra). Imported
explicitly: neither is loaded by ``import attention_residuals``.
"""
