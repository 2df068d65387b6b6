"""The Hub as kvrescue reaches it, through a stub endpoint on loopback that accepts connections, counts them and
closes them unanswered (a network that drops the Hub). The console script runs in its own process: huggingface_hub
reads HF_ENDPOINT and HF_HUB_OFFLINE when it is imported."""

import socket
import subprocess
import threading
from pathlib import Path

import orjson
import pytest

from kvrescue_cli import hub
from tests.helpers import KVRESCUE

SHIPPED_PRM = "Qwen/Qwen2.5-Math-PRM-7B"  # its config.json ships in kvrescue_cli/hub_configs/


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
    from kvrescue_cli.cost import Architecture

    files = sorted(hub.SHIPPED.glob("*.json"))
    assert files
    for path in files:
        model = path.stem.replace("--", "/")
        Architecture.from_config(model, orjson.loads(path.read_bytes()))
