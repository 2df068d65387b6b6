"""The Hub as kvrescue reaches it, through a stub endpoint on loopback that accepts connections, counts them and
closes them unanswered (a network that drops the Hub). The console script runs in its own process: huggingface_hub
reads HF_ENDPOINT and HF_HUB_OFFLINE when it is imported."""

import socket
import subprocess
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import orjson
import pytest

from kvrescue import hub
from tests.helpers import KVRESCUE

SHIPPED_PRM = "Qwen/Qwen2.5-Math-PRM-7B"  # its config.json ships in kvrescue/hub_configs/


class DroppingHub:
    """A TCP endpoint on loopback that accepts every connection and closes it at once, counting them."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.getsockname()[1]}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.server.close()


class ServingHub:
    """A Hub on loopback serving `config.json` of each model in `configs` at one commit, counting every request
    (method and path); anything else is a 404."""

    COMMIT = "c0ffee" * 6 + "c0ff"

    def __init__(self, configs: dict[str, dict]) -> None:
        files = {f"/{model}/resolve/main/config.json": orjson.dumps(cfg) for model, cfg in configs.items()}
        self.requests: Counter[tuple[str, str]] = Counter()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self, body: bool) -> None:
                hub.requests[self.command, self.path] += 1
                data = files.get(self.path)
                self.send_response(404 if data is None else 200)
                if data is not None:
                    self.send_header("X-Repo-Commit", hub.COMMIT)
                    self.send_header("ETag", f'"{hash(data) & 0xFFFFFFFF:08x}"')
                self.send_header("Content-Length", str(len(data or b"")))
                self.end_headers()
                if body and data:
                    self.wfile.write(data)

            def do_HEAD(self) -> None:
                self.answer(False)

            def do_GET(self) -> None:
                self.answer(True)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def dropping_hub():
    stub = DroppingHub()
    yield stub
    stub.close()


def kvrescue(args: list[str], stub: DroppingHub, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """The console script with the stub as the Hub and an empty Hugging Face cache."""
    environment = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"),
                   "HF_ENDPOINT": stub.url, **env}
    return subprocess.run([KVRESCUE, *args], capture_output=True, env=environment, timeout=300, cwd=tmp_path)


def test_offline_means_no_request_and_the_shipped_config_answers(dropping_hub, qwen2_dir, tmp_path):
    models = ["--base", str(qwen2_dir), "--helper", str(qwen2_dir), "--prm", SHIPPED_PRM]
    cost = kvrescue(["cost", *models, "--format", "json"], dropping_hub, tmp_path, HF_HUB_OFFLINE="1")
    assert cost.returncode == 0, cost.stderr.decode()
    assert "prm" in {device["role"] for device in orjson.loads(cost.stdout)["devices"]}
    plan = kvrescue(["run", *models, "--plan", "--device-memory", "80GB", "--devices", "cuda:0"], dropping_hub,
                    tmp_path, HF_HUB_OFFLINE="1")
    assert plan.returncode == 0, plan.stderr.decode()
    assert b"prm" in plan.stdout + plan.stderr
    assert dropping_hub.connections == 0


def test_a_hub_that_cannot_be_reached_is_probed_once_and_named_in_one_line(dropping_hub, problems, tmp_path):
    """The paper's models with no Hub: one connection (the probe), then one line; no retries per file."""
    done = kvrescue(["run", "--bench", str(problems), "--limit", "1", "--device", "cpu", "--out", "runs"],
                    dropping_hub, tmp_path)
    assert done.returncode == 2
    (error,) = [line for line in done.stderr.decode().splitlines() if line.startswith("error:")]
    assert "Qwen/Qwen2.5-Math-7B-Instruct" in error and f"{dropping_hub.url} did not answer" in error
    assert "Retrying" not in done.stderr.decode() and "Traceback" not in done.stderr.decode()
    assert dropping_hub.connections == 1


def test_the_shipped_config_files_are_whole_hub_configs():
    """Each shipped file is named after its Hub id and parses as a decoder config."""
    from kvrescue.cost import Architecture

    files = sorted(hub.SHIPPED.glob("*.json"))
    assert files
    for path in files:
        model = path.stem.replace("--", "/")
        Architecture.from_config(model, orjson.loads(path.read_bytes()))


def test_each_model_s_config_is_fetched_once_per_command(tmp_path):
    """The paper's three models on a Hub that serves their config.json: `run --plan`, then `cost` (the cache then
    holds them), each asks for each model's config.json once."""
    from kvrescue.cli import DEFAULT_MODELS
    from kvrescue_testkit.paper_shapes import PAPER_MODELS

    configs = {DEFAULT_MODELS[role]: {**shape, "model_type": "qwen2", "torch_dtype": "bfloat16", "architectures":
                                      ["Qwen2ForProcessRewardModel" if role == "prm" else "Qwen2ForCausalLM"]}
               for role, shape in PAPER_MODELS.items()}
    stub = ServingHub(configs)
    try:
        for args in (["run", "--plan", "--device-memory", "80GB", "--devices", "cuda:0"],
                     ["cost", "--prm", DEFAULT_MODELS["prm"]]):
            stub.requests.clear()
            done = kvrescue(args, stub, tmp_path)
            assert done.returncode == 0, done.stderr.decode()
            for model in configs:
                path = f"/{model}/resolve/main/config.json"  # one look (HEAD), a download unless cached (GET)
                fetched = {k: n for k, n in stub.requests.items() if k[1].startswith(f"/{model}/")}
                assert fetched.pop(("HEAD", path)) == 1 and fetched.pop(("GET", path), 0) <= 1 and not fetched
    finally:
        stub.close()
