"""Our models against the Hugging Face ``transformers`` implementation of the same checkpoint
(Mamba2 hybrids and Gated DeltaNet hybrids).

Each case writes a tiny random checkpoint, loads it both ways, and compares
all-position logits of a packed multi-row forward (float32, 1e-4 relative) and a
prefill + 32-token greedy decode through paged caches against ``generate``.
"""

from __future__ import annotations

import pytest
import torch
from paged_driver import PagedDriver

from hybridserve.models.loader import load_model
from hybridserve.testing.tiny_models import make_tiny_checkpoint

transformers = pytest.importorskip("transformers")

HF_CLASSES = {
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "bamba": "BambaForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_vl": "Qwen3_5ForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
}

# (arch, layer pattern, extra config): every pattern mixes Mamba and attention; the
# second of each starts and ends with attention and uses more groups.
CASES = [
    ("granitemoehybrid", "MAMMA", {}),
    ("granitemoehybrid", "AMMA", {"mamba_n_groups": 4}),
    ("granitemoehybrid", "MMAM", {"position_embedding_type": None, "tie_word_embeddings": True}),
    ("nemotron_h", "M*-M*-", {}),
    ("nemotron_h", "*M-M*", {"n_groups": 4}),
    ("bamba", "MAMMA", {}),
    ("bamba", "AMMA", {"mamba_n_groups": 4}),
    # Gated DeltaNet ("M"): 2 key heads shared by 4 value heads (8 in one case), conv
    # kernels 4 and 3, attention in the middle or first and last.
    ("qwen3_5", "MMAM", {}),
    ("qwen3_5", "AMMA", {"linear_conv_kernel_dim": 3, "linear_num_value_heads": 8}),
    ("qwen3_5_vl", "MMAM", {"tie_word_embeddings": True}),
    ("qwen3_5_vl", "AMMMA", {"linear_conv_kernel_dim": 3}),
    ("qwen3_next", "MMAM", {}),
    # Experts configured, but every layer is in mlp_only_layers: all MLPs are dense.
    ("qwen3_next", "AMMA", {"linear_conv_kernel_dim": 3, "num_experts": 4,
                            "mlp_only_layers": [0, 1, 2, 3]}),
]


def _ids(case):
    arch, layers, extra = case
    return f"{arch}-{layers}" + (
        "-" + "-".join(f"{k}={v}" for k, v in extra.items()) if extra else ""
    )


@pytest.fixture(scope="module", params=CASES, ids=_ids)
def pair(request, tmp_path_factory):
    arch, layers, extra = request.param
    seed = CASES.index(request.param)
    path = make_tiny_checkpoint(
        arch, tmp_path_factory.mktemp(arch), seed=seed, layers=layers, **extra
    )
    ours = load_model(path)
    ref = getattr(transformers, HF_CLASSES[arch]).from_pretrained(path, attn_implementation="eager")
    ref.eval()
    return arch, ours, ref


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_packed_prefill_logits_match_transformers(pair, test_seed):
    _, ours, ref = pair
    prompts = _prompts(test_seed, (1, 6, 19, 33))
    logits, _ = PagedDriver(ours).step(list(enumerate(prompts)))
    start = 0
    for p in prompts:
        with torch.no_grad():
            expected = ref(torch.tensor([p])).logits[0].float()
        got = logits[start : start + len(p)]
        start += len(p)
        assert _rel_err(got, expected) < 1e-4, f"prompt of {len(p)} tokens"


def test_packed_scan_prefill_logits_match_transformers(pair, test_seed):
    """Mamba2 hybrids through the packed path (the fused scan's torch twin: the raw dt
    discretised inside, states from the chunk grid), prompts across 64-token chunks."""
    arch, ours, ref = pair
    if not ours.cache_spec.mamba_layers or arch.startswith("qwen3"):
        pytest.skip("Mamba2 hybrids only")
    from hybridserve.config import KernelPolicy
    from hybridserve.models.loader import with_kernel_policy

    packed = with_kernel_policy(ours, KernelPolicy(short_rows="off", packed_prefill="reference"))
    prompts = _prompts(test_seed, (1, 64, 70, 130))
    logits, _ = PagedDriver(packed).step(list(enumerate(prompts)))
    start = 0
    for p in prompts:
        with torch.no_grad():
            expected = ref(torch.tensor([p])).logits[0].float()
        got = logits[start : start + len(p)]
        start += len(p)
        assert _rel_err(got, expected) < 1e-4, f"prompt of {len(p)} tokens"


def test_greedy_decode_matches_generate(pair, test_seed):
    _, ours, ref = pair
    (prompt,) = _prompts(test_seed, (13,))
    with torch.no_grad():
        expected = ref.generate(
            torch.tensor([prompt]),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert PagedDriver(ours).greedy(0, prompt, 32) == expected
