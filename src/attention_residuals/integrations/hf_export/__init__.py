"""The self-contained Hugging Face implementation that exports carry (imports only torch and transformers).

``configuration_attnres.py`` and ``modeling_attnres.py`` are written next to the weights by
``save_pretrained`` (their classes are registered for the auto classes), so
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` works where this package
is not installed. Nothing here imports the rest of the package: keep it that way (a test checks).
"""
