"""Build the training data and tokenizer of the embedded default model.

The corpus is the running interpreter's own standard library: every ``.py`` file under
``sysconfig.get_paths()["stdlib"]``, recursively, minus

- anything under ``site-packages`` (third-party code, differs per machine);
- ``pydoc_data/`` (generated help text, not code);
- the generated character-map codec tables in ``encodings/`` (their header says
  "generated from"): long runs of hex tables that teach nothing about Python;
- files that are not UTF-8 or that ``ast.parse`` rejects (the test suite ships some
  deliberately broken sources).

The test suites (``test/``, ``idlelib/idle_test/``, ``*/tests/``) are kept: they are
ordinary, idiomatic Python and double the corpus.

Each file goes to one split by a hash of its relative path (stable across machines
and runs): bucket ``sha256(path) mod 1000`` below 50 is ``val`` (held out, about 5%),
below 75 is ``dev`` (held out from training, used only to watch training), else
``train``.

Outputs:

- ``hybridserve/default_model/tokenizer.json`` and ``tokenizer_config.json``: a
  byte-level BPE trained on the train split only;
- ``hybridserve/default_model/data_manifest.json``: the sorted file list with splits
  and the sha256 of the concatenated contents;
- ``.data/{train,dev,val}.bin``: uint16 token ids, each file followed by
  ``<|endoftext|>`` and the whole stream starting with one, so every file is predicted
  after an end-of-text token;
- ``.data/train_functions.bin``: the train split's functions as documents of their own
  (:func:`function_documents`), in the same format; ``--functions-only`` writes just
  this file with the shipped tokenizer.

Usage: ``python scripts/prepare_default_data.py [--vocab-size 4096]``
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import platform
import sys
import sysconfig
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "hybridserve" / "default_model"
DATA_DIR = REPO / ".data"

EOS = "<|endoftext|>"
PAD = "<|pad|>"
VAL_BUCKETS = 50
DEV_BUCKETS = 25
MODEL_MAX_LENGTH = 1024


def stdlib_root() -> Path:
    """The directory holding the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(rel_path: str) -> str:
    """``val``, ``dev`` or ``train``: a pure function of the relative POSIX path."""
    bucket = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big") % 1000
    if bucket < VAL_BUCKETS:
        return "val"
    if bucket < VAL_BUCKETS + DEV_BUCKETS:
        return "dev"
    return "train"


def _exclusion(rel_path: str, raw: bytes) -> str | None:
    """Why a file is left out of the corpus, or None to keep it."""
    parts = rel_path.split("/")
    if parts[0] == "pydoc_data":
        return "generated"
    if parts[0] == "encodings" and b"generated from" in raw[:1000]:
        return "generated"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "not-utf8"
    try:
        ast.parse(text)
    except (SyntaxError, ValueError):
        return "unparseable"
    return None


def collect_files(root: Path) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """Kept ``(relative path, text)`` pairs sorted by path, and exclusion counts by reason."""
    kept: list[tuple[str, str]] = []
    excluded: dict[str, int] = {}
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).as_posix()
        # Third-party code installed into this interpreter is not the standard library.
        if not path.is_file() or "site-packages" in rel.split("/"):
            continue
        raw = path.read_bytes()
        why = _exclusion(rel, raw)
        if why is not None:
            excluded[why] = excluded.get(why, 0) + 1
            continue
        kept.append((rel, raw.decode("utf-8")))
    return kept, excluded


def corpus_sha256(files: list[tuple[str, str]]) -> str:
    """sha256 of the UTF-8 contents of ``files`` concatenated in the given order."""
    h = hashlib.sha256()
    for _, text in files:
        h.update(text.encode("utf-8"))
    return h.hexdigest()


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (no normalizer, so decoding is the exact inverse of encoding)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def tokenizer_config() -> dict:
    """The ``tokenizer_config.json`` that lets ``AutoTokenizer`` load tokenizer.json."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
    }


def function_documents(files: list[tuple[str, str]], seed: int = 0) -> list[str]:
    """Every function and method of ``files`` (nested ones too) as a document of its own:
    from its ``def`` line to its last line, decorators left out, its indentation removed
    (a line of a multi-line string indented less than the ``def`` is kept as it is), and
    only if the result parses. Shuffled with ``seed``, so a training window mixes files.

    Why: a file of the standard library rarely starts with a bare ``def``, but a
    completion request usually does (a header, then the body, then the end). These
    documents show the model whole functions after an end-of-text token and the end of
    text after them. Made from the train split only."""
    docs = []
    for _, text in files:
        lines = text.split("\n")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            cut = node.col_offset
            body = lines[node.lineno - 1 : node.end_lineno]
            doc = "\n".join(line[cut:] if not line[:cut].strip() else line for line in body) + "\n"
            try:
                ast.parse(doc)
            except SyntaxError:
                continue
            docs.append(doc)
    order = np.random.default_rng(seed).permutation(len(docs))
    return [docs[i] for i in order]


def encode_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """``EOS f1 EOS f2 EOS ... fN EOS`` as uint16 ids."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = [eos]
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    arr = np.asarray(ids, dtype=np.int64)
    assert arr.max() < 2**16
    return arr.astype(np.uint16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--functions-only", action="store_true",
                        help="only (re)write .data/train_functions.bin with the shipped tokenizer")
    args = parser.parse_args()

    root = stdlib_root()
    files, excluded = collect_files(root)
    splits: dict[str, list[tuple[str, str]]] = {"train": [], "dev": [], "val": []}
    for rel, text in files:
        splits[split_of(rel)].append((rel, text))
    if args.functions_only:
        write_function_documents(Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")),
                                 splits["train"])
        return

    tok = train_tokenizer([t for _, t in splits["train"]], args.vocab_size)
    for _, text in splits["val"][:20]:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    tok.save(str(MODEL_DIR / "tokenizer.json"))
    (MODEL_DIR / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")

    DATA_DIR.mkdir(exist_ok=True)
    stats = {}
    for name, items in splits.items():
        arr = encode_stream(tok, [t for _, t in items])
        arr.tofile(DATA_DIR / f"{name}.bin")
        stats[name] = {
            "files": len(items),
            "bytes": sum(len(t.encode("utf-8")) for _, t in items),
            "tokens": int(arr.size),
            "sha256": corpus_sha256(items),
        }
        print(f"{name}: {stats[name]['files']} files, {stats[name]['bytes']} bytes, "
              f"{stats[name]['tokens']} tokens")

    stats["train_functions"] = write_function_documents(tok, splits["train"])

    manifest = {
        "source": "Python standard library (.py files of sysconfig stdlib path, recursive)",
        "python_version": platform.python_version(),
        "python_implementation": sys.implementation.name,
        "filters": {
            "excluded": ["site-packages/", "pydoc_data/ (generated)",
                         "encodings/ character-map tables ('generated from' header)",
                         "files not valid UTF-8", "files ast.parse rejects"],
            "test_directories": "included",
            "excluded_counts": excluded,
        },
        "split_rule": (f"bucket = int(sha256(relative_path)[:8 bytes], big-endian) % 1000; "
                       f"val if bucket < {VAL_BUCKETS}, dev if bucket < "
                       f"{VAL_BUCKETS + DEV_BUCKETS}, else train"),
        "stream_format": "EOS f1 EOS f2 ... fN EOS, uint16 token ids, files in sorted order",
        "num_files": len(files),
        "num_bytes": sum(s["bytes"] for s in stats.values()),
        "sha256_concatenated": corpus_sha256(files),
        "splits": stats,
        "files": [[rel, split_of(rel)] for rel, _ in files],
    }
    (MODEL_DIR / "data_manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (DATA_DIR / "meta.json").write_text(json.dumps({"vocab_size": tok.get_vocab_size(),
                                                    "eos_id": tok.token_to_id(EOS),
                                                    "pad_id": tok.token_to_id(PAD),
                                                    "splits": stats}, indent=1) + "\n")
    print(f"files {len(files)} excluded {excluded} sha256 {manifest['sha256_concatenated']}")


def write_function_documents(tok: Tokenizer, train: list[tuple[str, str]]) -> dict:
    """``.data/train_functions.bin``: :func:`function_documents` of the train split, in the
    stream format; returns its statistics."""
    docs = function_documents(train)
    arr = encode_stream(tok, docs)
    DATA_DIR.mkdir(exist_ok=True)
    arr.tofile(DATA_DIR / "train_functions.bin")
    stats = {"documents": len(docs), "bytes": sum(len(d.encode("utf-8")) for d in docs),
             "tokens": int(arr.size)}
    print(f"train functions: {stats['documents']} documents, {stats['bytes']} bytes, "
          f"{stats['tokens']} tokens")
    return stats


if __name__ == "__main__":
    main()
