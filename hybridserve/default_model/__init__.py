"""The embedded default model: a 9.3M-parameter Granite 4.0-H style hybrid trained on
the Python standard library (see README.md here, the model card).

``PATH`` is the directory holding its Hugging Face files (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json).
"""

from pathlib import Path

PATH = Path(__file__).resolve().parent
