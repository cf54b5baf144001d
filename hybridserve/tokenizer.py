"""Tokenizer loading: ``tokenizer.json`` through the ``tokenizers`` library, special
tokens and the chat template from ``tokenizer_config.json`` (or ``chat_template.jinja``).

A beginning-of-text token is added to encoded text as the checkpoint declares it,
either way real checkpoints do: a post-processor in ``tokenizer.json`` (applied by the
``tokenizers`` library) or ``add_bos_token: true`` in ``tokenizer_config.json`` (with
its ``bos_token``); never twice. ``encode(text, add_special_tokens=False)`` adds none
(chat templates write their own).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

CHAT_TEMPLATE_FILE = "chat_template.jinja"


class TokenizerError(ValueError):
    """A tokenizer file is missing or unreadable; the message names the file."""


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """A thin wrapper with the few calls the engine needs (encode, decode, specials)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        try:
            self._tok = _HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the library raises a bare Exception on bad files
            raise TokenizerError(f"cannot read {tok_file}: {e}") from e
        cfg: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.exists():
            try:
                cfg = json.loads(cfg_file.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise TokenizerError(f"cannot read {cfg_file}: {e}") from e
        self.config = cfg
        self.chat_template: str | None = cfg.get("chat_template")
        # transformers (since 4.43) saves the template as its own file; it wins, as there.
        template_file = path / CHAT_TEMPLATE_FILE
        if template_file.is_file():
            try:
                self.chat_template = template_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"cannot read {template_file}: {e}") from e
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.eos_token_id = self.token_to_id(self.eos_token)

    @staticmethod
    def maybe_load(path: str | Path) -> Tokenizer | None:
        """The checkpoint's tokenizer, or None when it ships no ``tokenizer.json``."""
        return Tokenizer(path) if (Path(path) / "tokenizer.json").exists() else None

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return self._with_bos(ids, add_special_tokens)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``[encode(t) for t in texts]``, computed with the interpreter lock released
        (the library's single-text call holds it throughout), so a server's event loop
        keeps running while a long prompt is tokenized on another thread."""
        encodings = self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [self._with_bos(e.ids, add_special_tokens) for e in encodings]

    def _with_bos(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what grammar backends read)."""
        return self._tok.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)
