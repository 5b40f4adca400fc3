"""Floor 5: AttnRes inside other libraries' models.

``patch``: :func:`apply_attnres` rewires the decoder layers of an existing model (a ``transformers``
Llama, Qwen2, GPT-2...) to AttnRes in place; :func:`load_patched` reloads a saved patched model.
``hf``: the bundled GPT as a ``transformers`` model and the ``attnres export-hf`` command (needs
the ``[hf]`` extra); its model classes live in ``hf_export``, self-contained files that travel with
every export. ``k3``: the state-dict adapter to the Kimi K3 AttnRes naming. ``autoregister``: the
import hook by which ``import attention_residuals`` registers the HF classes without importing
``transformers``. Only ``patch`` and ``autoregister`` are imported by ``import attention_residuals``.
"""
