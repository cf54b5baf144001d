"""End-to-end generation through LLM: parity with transformers, batch invariance,
preemption, sampling options and bad input."""

from __future__ import annotations

import random

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.models.config import ConfigError

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def _prompts(seed: int, count: int, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["tiny_granite", "tiny_nemotron", "tiny_bamba"])
def test_greedy_matches_transformers_generate(arch, request):
    import transformers

    path = request.getfixturevalue(arch)
    prompts = _prompts(10, 3, 5, 40)
    llm = LLM(path, max_num_seqs=4)
    ours = _tokens(llm.generate(prompts, GREEDY))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, ours):
        ids = torch.tensor([prompt])
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, len(prompt):].tolist()
        assert got == ref


def test_batch_invariance_and_chunked_prefill(tiny_granite):
    prompts = _prompts(11, 16, 3, 70)
    single = LLM(tiny_granite, max_num_seqs=1, enable_prefix_caching=False)
    alone = [_tokens(single.generate([p], GREEDY))[0] for p in prompts]
    llm = LLM(tiny_granite, max_num_seqs=16)
    batched = _tokens(llm.generate(prompts, GREEDY))
    chunked = _tokens(LLM(tiny_granite, max_num_seqs=16, max_num_batched_tokens=7).generate(prompts, GREEDY))
    assert batched == alone
    assert chunked == batched


def test_preemption_keeps_outputs(tiny_granite):
    prompts = _prompts(12, 8, 20, 40)
    ref = _tokens(LLM(tiny_granite, max_num_seqs=8).generate(prompts, GREEDY))
    # 8 requests of up to 72 tokens need ~40 blocks; give 14 so they must take turns.
    llm = LLM(tiny_granite, max_num_seqs=8, max_model_len=128, num_kv_blocks=14)
    llm.engine.check_integrity_every_step = True
    got = _tokens(llm.generate(prompts, GREEDY))
    assert llm.stats()["preemptions"] > 0
    assert got == ref


def test_seeded_sampling_is_reproducible_across_batches(tiny_granite):
    params = SamplingParams(max_tokens=20, temperature=0.9, top_k=50, top_p=0.9, seed=1234)
    prompt = _prompts(13, 1)[0]
    llm = LLM(tiny_granite, max_num_seqs=8)
    alone = _tokens(llm.generate([prompt], params))[0]
    in_batch = _tokens(llm.generate(_prompts(14, 5) + [prompt], params))[-1]
    assert alone == in_batch
    other = _tokens(llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.9, seed=99)))[0]
    assert other != alone


def test_n_logprobs_and_stop_options(tiny_granite):
    llm = LLM(tiny_granite, max_num_seqs=8)
    prompt = _prompts(15, 1)[0]
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7, logprobs=3))[0]
    assert len(out.outputs) == 3 and [c.index for c in out.outputs] == [0, 1, 2]
    for comp in out.outputs:
        assert len(comp.logprobs) == len(comp.token_ids) == 8
        for tok, lp in zip(comp.token_ids, comp.logprobs):
            assert tok in lp and 3 <= len(lp) <= 4
            ranks = sorted(v.rank for v in lp.values())
            assert ranks[:3] == [1, 2, 3]
            assert all(v.logprob <= 0 for v in lp.values())
    greedy = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    stop_tok = greedy[5]
    first = greedy.index(stop_tok)
    out = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0, stop_token_ids=[stop_tok]))[0]
    assert out.outputs[0].token_ids == greedy[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok


def test_text_prompts_and_stop_strings(tiny_granite):
    llm = LLM(tiny_granite, max_num_seqs=4)
    full = llm.generate("def f(x):", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    text = full.outputs[0].text
    assert full.prompt == "def f(x):" and len(full.outputs[0].token_ids) == 24
    stop = text[6:8]
    if not stop or stop in text[:6]:
        pytest.skip("generated text too short for a stop-string check")
    cut = llm.generate("def f(x):", SamplingParams(max_tokens=24, temperature=0, stop=[stop], ignore_eos=True))[0]
    assert cut.outputs[0].text == text[: text.index(stop)]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop


def test_eos_stops_unless_ignored(tiny_granite):
    llm = LLM(tiny_granite, max_num_seqs=4)
    prompt = _prompts(16, 1)[0]
    greedy = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    eos = greedy[3]
    llm.engine.eos_token_ids = (eos,)
    stopped = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0))[0].outputs[0]
    assert stopped.token_ids == greedy[: greedy.index(eos) + 1] and stopped.finish_reason == "stop"


def test_bad_input_is_refused_and_engine_keeps_serving(tiny_granite, tmp_path):
    llm = LLM(tiny_granite, max_num_seqs=4, max_model_len=64)
    prompt = _prompts(17, 1, 5, 20)[0]
    ref = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([prompt, list(range(3, 70))], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-3)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=bad)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[1, 2, 999]], GREEDY)
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == ref
    assert not llm.engine.has_unfinished_requests()
    llm.engine.scheduler.check_integrity()


def test_bad_checkpoints_are_refused(tiny_granite, tmp_path):
    import json
    import shutil

    bad = tmp_path / "arch"
    shutil.copytree(tiny_granite, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="LlamaForCausalLM"):
        LLM(bad)
    trunc = tmp_path / "trunc"
    shutil.copytree(tiny_granite, trunc)
    f = trunc / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(trunc)


def test_engine_options_are_validated(tiny_granite):
    with pytest.raises(ValueError, match="state_interval"):
        LLM(tiny_granite, state_interval=40)
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_granite, dtype="int8")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(tiny_granite, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="method"):
        LLM(tiny_granite, speculative_config={"method": "eagle"})


def test_extreme_sampling_values_do_not_break_a_step(tiny_granite):
    llm = LLM(tiny_granite, max_num_seqs=4)
    prompt = _prompts(18, 1)[0]
    greedy = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    tiny_t = SamplingParams(max_tokens=32, temperature=1e-30, ignore_eos=True)
    assert tiny_t.temperature == 0.0  # the limit of sampling as temperature -> 0
    outs = llm.generate([prompt, prompt], [tiny_t, SamplingParams(max_tokens=32, top_p=5e-324, seed=1, ignore_eos=True)])
    assert outs[0].outputs[0].token_ids == greedy
    # A top_p that small keeps only the most likely token: greedy again.
    assert outs[1].outputs[0].token_ids == greedy
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-39)


def test_failed_forward_leaks_nothing_and_engine_recovers(tiny_granite, monkeypatch):
    llm = LLM(tiny_granite, max_num_seqs=4)
    prompt = _prompts(19, 1)[0]
    ref = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    runner = llm.engine.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(sched, *args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real(sched, *args)

    monkeypatch.setattr(runner, "execute", flaky)
    llm.engine.add_request("r", prompt, GREEDY)
    with pytest.raises(RuntimeError, match="injected"):
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    llm.engine.scheduler.check_integrity()
    done = None
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            done = out if out.finished else done
    assert done.outputs[0].token_ids == ref
    llm.engine.scheduler.check_integrity()


def test_chat_renders_the_template(tiny_granite):
    llm = LLM(tiny_granite, max_num_seqs=4)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="chat template"):
        llm.chat(messages)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    template += "{% if add_generation_prompt %}<assistant>{% endif %}"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.chat([messages, messages + [{"role": "user", "content": "more"}]], params, chat_template=template)
    assert [o.prompt for o in out] == ["<user>hi\n<assistant>", "<user>hi\n<user>more\n<assistant>"]
    direct = llm.generate(["<user>hi\n<assistant>"], params)[0]
    assert out[0].outputs[0].token_ids == direct.outputs[0].token_ids


def test_any_stop_string_is_reported_and_cut_as_given(tiny_granite):
    """A stop string that happens to spell "eos" is still a stop string; EOS itself
    reports no stop_reason."""
    from hybridserve.engine.request import Request

    llm = LLM(tiny_granite, max_num_seqs=4)
    engine = llm.engine
    req = Request("r", [5, 6], SamplingParams(stop=["eos"]), arrival=0)
    for tok in llm.tokenizer.encode("ab eos xy"):
        req.append_output(tok)
    engine._mark_stop(req, "eos")
    assert engine._decode(req) == "ab "
    full = llm.generate("def f(x):", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    engine.eos_token_ids = (full.outputs[0].token_ids[2],)
    out = llm.generate("def f(x):", SamplingParams(max_tokens=24, temperature=0))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids == full.outputs[0].token_ids[: full.outputs[0].token_ids.index(engine.eos_token_ids[0]) + 1]


def test_cache_sizing_is_checked_against_free_memory(tiny_granite):
    from hybridserve.config import CacheConfig
    from hybridserve.llm import check_cache_fits

    llm = LLM(tiny_granite)
    spec = llm.model.cache_spec
    cache = CacheConfig(num_kv_blocks=100, num_state_pages=50)
    need = check_cache_fits(spec, cache, torch.float32, free_bytes=1 << 40)
    kv = spec.kv_block_bytes(16, torch.float32) * 100
    assert need == kv + spec.state_page_bytes(torch.float32, torch.float32) * 50
    with pytest.raises(ValueError, match="num_state_pages"):
        check_cache_fits(spec, cache, torch.float32, free_bytes=need)


def test_final_only_requests_report_once_when_finished(tiny_granite):
    llm = LLM(tiny_granite)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, n=2, seed=3)
    eng.add_request("every", [5, 6, 7, 8], params)
    eng.add_request("final", [5, 6, 7, 8], params, final_only=True)
    seen: dict[str, list] = {"every": [], "final": []}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id].append(out)
    assert len(seen["every"]) > 1 and not seen["every"][0].finished
    assert len(seen["final"]) == 1 and seen["final"][0].finished
    # The same finished output either way.
    want = [(o.token_ids, o.finish_reason) for o in seen["every"][-1].outputs]
    assert [(o.token_ids, o.finish_reason) for o in seen["final"][0].outputs] == want
    assert not eng.groups
