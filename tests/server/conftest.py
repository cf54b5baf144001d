"""Server fixtures: a tiny random checkpoint with a byte-level tokenizer and a chat
template, and the real HTTP server (uvicorn, as ``hybridserve serve`` runs it) on
127.0.0.1 in a thread for the tests."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from hybridserve.testing.tiny_models import make_tiny_checkpoint

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role ' ~ m['role'] ~ ' is not supported') }}"
    "{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

# A Qwen-like template: tools in a system turn, calls as <tool_call> JSON, tool results
# as <tool_response>, and <think> opened by the generation prompt with enable_thinking.
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<system>Tools:{% for t in tools %} {{ t | tojson }}{% endfor %}{{ eos_token }}\n{% endif %}"
    "{% if documents %}<documents>{% for d in documents %}[{{ d.title }}] {{ d.text }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<tool_response id={{ m.tool_call_id }}>{{ m.content }}</tool_response>\n"
    "{% elif m.tool_calls %}<assistant>{{ m.content or '' }}"
    "{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}{{ eos_token }}\n"
    "{% else %}<{{ m.role }}>{% generation %}{{ m.content }}{% endgeneration %}{{ eos_token }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)


def write_byte_tokenizer(
    path: Path, chat_template: str | None = None, eos_id: int = 2, eos_special: bool = False
) -> None:
    """A tokenizer whose 256 ids are the 256 bytes (the tiny models' vocabulary).
    ``eos_special``: the EOS byte is a special token, so decoding skips it (as a real
    tokenizer's EOS), instead of showing its byte in the text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if eos_special:
        tok.add_special_tokens([AddedToken(alphabet[eos_id], special=True)])
    tok.save(str(path / "tokenizer.json"))
    cfg: dict[str, Any] = {"eos_token": alphabet[eos_id]}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # The tiny model's ops are far too small to split across threads; on a busy
    # two-core machine extra OpenMP threads only spin and slow every step down.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="package")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_checkpoint("granitemoehybrid", tmp_path_factory.mktemp("srv"), seed=1)
    write_byte_tokenizer(path, CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="package")
def chat_template_text() -> str:
    return CHAT_TEMPLATE


@pytest.fixture(scope="package")
def plain_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same kind of model without a chat template."""
    path = make_tiny_checkpoint("granitemoehybrid", tmp_path_factory.mktemp("plain"), seed=1)
    write_byte_tokenizer(path)
    return path


class ServerThread:
    """The HTTP server for ``app`` on a free loopback port, in a daemon thread;
    ``options`` are :class:`~hybridserve.server.http.HTTPOptions` fields."""

    def __init__(self, app: Any, **options: Any) -> None:
        from hybridserve.server.http import HTTPOptions, make_server

        options.setdefault("graceful_shutdown_timeout", 5.0)
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(app, options=HTTPOptions(**options), log_level="warning")
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    @property
    def engine(self) -> Any:
        return self.app.state.server.engine

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()
        assert not self.thread.is_alive(), "the test server did not stop"

    def wait_idle(self, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until the engine runs nothing; returns its counters."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine.stats_sync(timeout)
            if stats["requests_running"] == 0 and stats["requests_waiting"] == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine is still busy: {stats}")
            time.sleep(0.05)


def start_server(model: Path, **kwargs: Any) -> ServerThread:
    """Load ``model`` and serve it; ``kwargs`` go to LLM (engine), create_app (server)
    or HTTPOptions (connections)."""
    import inspect
    from dataclasses import fields

    from hybridserve import LLM
    from hybridserve.server import create_app
    from hybridserve.server.http import HTTPOptions

    app_keys = set(inspect.signature(create_app).parameters) - {"llm"}
    app_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in app_keys}
    http_keys = {f.name for f in fields(HTTPOptions)}
    http_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in http_keys}
    kwargs.setdefault("max_num_seqs", 32)
    llm = LLM(model, **kwargs)
    return ServerThread(create_app(llm, **app_kwargs), **http_kwargs).start()


@pytest.fixture
def server_factory() -> Iterator[Any]:
    """``server_factory(model, **kwargs)`` starts a server that is stopped after the test."""
    started: list[ServerThread] = []

    def make(model: Path, **kwargs: Any) -> ServerThread:
        started.append(start_server(model, **kwargs))
        return started[-1]

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture(scope="module")
def server(chat_model: Path) -> Iterator[ServerThread]:
    srv = start_server(chat_model, served_model_name="tiny")
    yield srv
    srv.stop()


@pytest.fixture
def client(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="package")
def reference_llm(chat_model: Path) -> Any:
    """An offline LLM over the same checkpoint, for expected outputs."""
    from hybridserve import LLM

    return LLM(chat_model, max_num_seqs=64)


@pytest.fixture(scope="package")
def launch() -> Any:
    """:func:`start_server` for fixtures of any scope (the caller stops the server)."""
    return start_server


@pytest.fixture(scope="package")
def byte_tokenizer() -> Any:
    """:func:`write_byte_tokenizer`, for fixtures that build their own checkpoint."""
    return write_byte_tokenizer


@pytest.fixture(scope="package")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint with :data:`TOOL_TEMPLATE` and an EOS that decoding skips."""
    path = make_tiny_checkpoint("granitemoehybrid", tmp_path_factory.mktemp("tools"), seed=3)
    write_byte_tokenizer(path, TOOL_TEMPLATE, eos_special=True)
    return path


@pytest.fixture(scope="module")
def tool_server(tool_model: Path) -> Iterator[ServerThread]:
    """``tool_model`` served with the hermes tool parser (auto tool choice on) and the
    qwen3 reasoning parser, as ``tiny``."""
    srv = start_server(
        tool_model,
        served_model_name="tiny",
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
        reasoning_parser="qwen3",
        max_model_len=2048,
    )
    yield srv
    srv.stop()
