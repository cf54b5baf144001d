"""Two CPU replicas on a local Ray cluster behind the checkpoint-routing ingress."""

import os
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow  # starting Ray and two engines takes about a minute here

PORT = 8781
ENGINE = dict(max_num_seqs=4, num_cpus_per_replica=1)


@pytest.fixture(scope="module")
def cluster():
    from ray import serve

    from hybridserve.routing.ray_app import build_app

    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app(None, num_replicas=2, **ENGINE), route_prefix="/", name="hs")
    client = httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=300)
    yield client
    client.close()
    serve.shutdown()
    ray.shutdown()


def _turns(client, openers, turns=3):
    """Multi-turn conversations sent round by round; returns per conversation the
    (replica, prompt tokens, cached tokens) of each turn, and the prompts sent."""
    hist = list(openers)
    seen = [[] for _ in openers]
    prompts = []
    for t in range(turns):
        # Alternate the order, so that rotating over idle replicas cannot look sticky.
        order = range(len(hist)) if t % 2 == 0 else reversed(range(len(hist)))
        for c in order:
            body = {"prompt": hist[c], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            j = r.json()
            u = j["usage"]
            seen[c].append((int(r.headers["x-hybridserve-replica"]), u["prompt_tokens"],
                            u["prompt_tokens_details"]["cached_tokens"]))
            prompts.append(hist[c])
            hist[c] += j["choices"][0]["text"] + f"\n# turn {len(seen[c])}\n"
    return seen, prompts


def test_turns_stick_and_hit_like_one_replica(cluster):
    from hybridserve import LLM, SamplingParams

    openers = [f"def task_{c}(x):\n" + f"    # conversation {c}\n" * 12 for c in range(3)]
    seen, prompts = _turns(cluster, openers)
    for conv in seen:
        assert len({r for r, _, _ in conv}) == 1, conv  # every turn on one replica
    assert len({conv[0][0] for conv in seen}) == 2  # and both replicas used
    routed_hit = sum(c for conv in seen for _, _, c in conv) / sum(p for conv in seen for _, p, _ in conv)
    # One replica (the same engine, in-process) serving the same prompts in order.
    llm = LLM(None, max_num_seqs=4)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    single_hit = sum(o.num_cached_tokens for o in outs) / sum(len(o.prompt_token_ids) for o in outs)
    assert routed_hit > 0.3
    assert routed_hit >= single_hit - 0.05, (routed_hit, single_hit)


def test_a_dying_replica_fails_only_its_requests(cluster):
    from ray import serve

    probe = cluster.post("/v1/completions", json={"prompt": "def victim():\n" * 20, "max_tokens": 2})
    victim = int(probe.headers["x-hybridserve-replica"])
    pid = serve.get_deployment_handle(f"engine-{victim}", app_name="hs").pid.remote().result()
    result = {}

    def long_request():
        body = {"prompt": "def victim():\n" * 20, "max_tokens": 900, "ignore_eos": True}
        result["r"] = cluster.post("/v1/completions", json=body)
        result["done"] = time.monotonic()

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while cluster.get("/v1/replicas").json()["replicas"][victim]["queue"] == 0:
        assert "r" not in result, (victim, result["r"].headers, cluster.get("/v1/replicas").json())
        assert time.monotonic() < deadline, "the long request never reached the victim"
        time.sleep(0.05)
    time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    t.join(timeout=120)
    r = result["r"]
    assert result["done"] > killed, "the request finished before the replica was killed"
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "replica_unavailable"
    # Requests keep being served (by the other replica, or the victim once Serve has
    # restarted it with empty caches: the router forgot what it held).
    served = set()
    for i in range(4):
        ok = cluster.post("/v1/completions", json={"prompt": f"def other_{i}():\n", "max_tokens": 3})
        assert ok.status_code == 200, ok.text
        served.add(int(ok.headers["x-hybridserve-replica"]))
    assert 1 - victim in served
    stats = cluster.get("/v1/replicas").json()["replicas"]
    assert stats[victim]["failures"] == 1
    assert stats[1 - victim]["failures"] == 0
    assert "hybridserve_router_failures_total" in cluster.get("/metrics").text
