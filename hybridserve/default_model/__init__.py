"""The embedded default model: a 9.3M-parameter Granite 4.0-H style hybrid trained on
the Python standard library (see README.md here, the model card), and its draft model.

``PATH`` is the directory holding its Hugging Face files (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json).
``DRAFT_PATH`` is the draft model trained for it (``draft/README.md``): a 1.2M-parameter
hybrid with the same tokenizer, distilled from the default model, for
``speculative_config={"method": "draft_model", "model": "default-draft"}``.
"""

from pathlib import Path

PATH = Path(__file__).resolve().parent
DRAFT_PATH = PATH / "draft"
