"""Offline API options a newcomer meets first: the CPU thread count, max_tokens that
do not fit in the context, and the beginning-of-text token a checkpoint declares."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.llm import NUM_THREADS_ENV, resolve_num_threads


@pytest.fixture
def restore_threads(monkeypatch):
    monkeypatch.delenv(NUM_THREADS_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_thread_count_default_env_and_argument(tiny_granite, monkeypatch, restore_threads):
    torch.set_num_threads(2)
    LLM(tiny_granite, max_num_seqs=2)
    assert torch.get_num_threads() == 1  # the default
    LLM(tiny_granite, max_num_seqs=2, num_threads=2)
    assert torch.get_num_threads() == 2
    monkeypatch.setenv(NUM_THREADS_ENV, "1")
    LLM(tiny_granite, max_num_seqs=2)
    assert torch.get_num_threads() == 1
    assert resolve_num_threads(3) == 3  # the argument wins over the environment
    monkeypatch.delenv(NUM_THREADS_ENV)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert resolve_num_threads(None) is None  # torch follows OMP_NUM_THREADS itself


def test_bad_thread_counts_are_refused_by_name(monkeypatch, restore_threads):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_threads must be an integer >= 1"):
            resolve_num_threads(bad)
    monkeypatch.setenv(NUM_THREADS_ENV, "many")
    with pytest.raises(ValueError, match=rf"\${NUM_THREADS_ENV} must be an integer >= 1, got 'many'"):
        resolve_num_threads(None)


def test_max_tokens_beyond_the_context_is_capped_with_one_warning(tiny_granite):
    llm = LLM(tiny_granite, max_num_seqs=2, max_model_len=32)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    with pytest.warns(UserWarning, match=r"max_tokens=100 does not fit in max_model_len=32: its "
                      r"output is capped at 29 tokens") as record:
        out = llm.generate(["abc"], params, use_tqdm=False)[0].outputs[0]
    assert len(record) == 1 and record[0].filename == __file__  # points at the caller
    assert len(out.token_ids) == 29 and out.finish_reason == "length"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per LLM: no second warning
        llm.generate(["abcd"], params, use_tqdm=False)
        # A max_tokens that fits, or None (to the end of the context), never warns.
        other = LLM(tiny_granite, max_num_seqs=2, max_model_len=32)
        other.generate(["abc"], SamplingParams(max_tokens=29, temperature=0), use_tqdm=False)
        other.generate(["abc"], SamplingParams(max_tokens=None, temperature=0), use_tqdm=False)
    # A prompt that leaves no room at all is refused, as vLLM does.
    with pytest.raises(ValueError, match="prompt 0 has 32 tokens but max_model_len is 32"):
        llm.generate(["x" * 32], params)


def _with_tokenizer_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg_file = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(changes)
    cfg_file.write_text(json.dumps(cfg))
    return dst


def test_a_declared_bos_is_added_to_text_prompts(tiny_granite, tmp_path):
    from tokenizers import Tokenizer, pre_tokenizers, processors

    bos = sorted(pre_tokenizers.ByteLevel.alphabet())[0]  # id 0 of the byte-level test vocabulary
    plain = LLM(tiny_granite, max_num_seqs=2).get_tokenizer().encode("hi")
    # Declared in tokenizer_config.json (add_bos_token + bos_token).
    by_config = _with_tokenizer_config(tiny_granite, tmp_path / "config", add_bos_token=True,
                                       bos_token=bos)
    # Declared by a post-processor in tokenizer.json.
    by_processor = _with_tokenizer_config(tiny_granite, tmp_path / "processor", bos_token=bos)
    tok = Tokenizer.from_file(str(by_processor / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 0)])
    tok.save(str(by_processor / "tokenizer.json"))
    # Both at once: still one BOS.
    both = _with_tokenizer_config(by_processor, tmp_path / "both", add_bos_token=True)
    for path in (by_config, by_processor, both):
        llm = LLM(path, max_num_seqs=2)
        assert llm.get_tokenizer().encode("hi") == [0, *plain], path.name
        out = llm.generate(["hi"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
        assert out.prompt_token_ids == [0, *plain]
        assert llm.get_tokenizer().encode("hi", add_special_tokens=False) == plain


def test_chat_template_file_is_read(tiny_granite, tmp_path):
    path = shutil.copytree(tiny_granite, tmp_path / "ckpt")
    (path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    llm = LLM(path, max_num_seqs=2)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert out[0].prompt == "[hi]"
