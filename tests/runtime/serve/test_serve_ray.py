"""paradecode-serve on Ray Serve: the same app, one model per Ray replica, on a local Ray instance.

Small on purpose: exports/llama (a tiny random Llama, token-id prompts) and at most two replicas of
half a CPU each. Skipped, saying why, where Ray is not installed (`pip install paradecode[ray]`).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import replace

import httpx
import pytest

from paradecode.graphs.errors import UserInputError
from paradecode.runtime import GenerationConfig, load
from paradecode.runtime.serve.config import RayConfig, ServeConfig
from tests.conftest import REPO
from tests.serving import free_port, sse_events, wait_until

ray = pytest.importorskip("ray", reason="Ray is not installed: `pip install paradecode[ray]`")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed: `pip install paradecode[ray]`")
from paradecode.runtime.serve.ray_serve import APP_NAME, deployment, deployment_options  # noqa: E402

pytestmark = pytest.mark.timeout(600)

NAME = "tiny"
GENERATION = GenerationConfig(thresholds=0.0)
PROMPT_IDS = [1, 5, 9, 2]


def config_of(folder) -> ServeConfig:
    return ServeConfig(folder, served_model_name=NAME, generation=GENERATION, max_queue=2)


def test_deployment_options_pass_resources_and_autoscaling_through(exports):
    config = config_of(exports["llama"][0])
    fixed = deployment_options(config, RayConfig(replicas=3, num_cpus=2, num_gpus=0.5))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0.5}
    # twice what a replica holds: its batch (the export's max_batch, 8 by default) and its queue of 2
    assert fixed["max_ongoing_requests"] == 2 * (8 + 2) and fixed["graceful_shutdown_timeout_s"] == 30
    assert deployment_options(replace(config, max_batch=1), RayConfig())["max_ongoing_requests"] == 2 * (1 + 2)
    scaling = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2}
    scaled = deployment_options(config, RayConfig(autoscaling=scaling, max_ongoing_requests=7))
    assert scaled["autoscaling_config"] == scaling and "num_replicas" not in scaled
    assert scaled["max_ongoing_requests"] == 7
    with pytest.raises(UserInputError, match="not a valid Ray Serve autoscaling_config"):
        deployment_options(config, RayConfig(autoscaling={"min_replicas": 5, "max_replicas": 1}))


@pytest.mark.slow
def test_paradecode_serve_ray_cli(exports, tmp_path):
    """`paradecode-serve DIR --ray`: Ray started by the command, one replica, a request, SIGTERM."""
    port = free_port()
    log = tmp_path / "log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "paradecode.runtime.serve.cli",
                str(exports["llama"][0]),
                "--ray",
                "--replicas",
                "1",
                "--num-cpus",
                "1",
                "--port",
                str(port),
                "--served-model-name",
                NAME,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert process.poll() is None, log.read_text()
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 240, "Ray Serve's start")
        body = {"model": NAME, "prompt": PROMPT_IDS, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert len(answer["choices"][0]["token_ids"]) == 6 and answer["usage"]["completion_tokens"] == 6
        process.send_signal(signal.SIGTERM)
        process.wait(120)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM, log.read_text()
    assert "stopped (received SIGTERM)" in log.read_text()


@pytest.fixture(scope="module")
def ray_port():
    """A local Ray instance with Serve's HTTP proxy on a free localhost port."""
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 << 20)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()
    ray.shutdown()


@pytest.mark.slow
def test_two_ray_replicas_serve_what_generate_gives(ray_port, exports):
    folder = exports["llama"][0]
    with load(folder) as model:
        want = model.generate(prompt_ids=PROMPT_IDS, config=GENERATION, max_new_tokens=12, ignore_eos=True)
    serve.run(deployment(config_of(folder), RayConfig(replicas=2, num_cpus=0.5)), name=APP_NAME, route_prefix="/")
    url = f"http://127.0.0.1:{ray_port}"
    try:
        replicas = serve.status().applications[APP_NAME].deployments[APP_NAME].replica_states
        assert replicas == {"RUNNING": 2}
        body = {"model": NAME, "prompt": PROMPT_IDS, "max_tokens": 12, "ignore_eos": True, "return_token_ids": True}
        with httpx.Client(base_url=url, timeout=60) as client:
            for _ in range(4):  # Ray spreads these over both replicas; every answer is the same
                answer = client.post("/v1/completions", json=body).json()
                assert answer["choices"][0]["token_ids"] == want.token_ids
                assert answer["paradecode"]["rollbacks"] == want.stats.rollbacks
            *chunks, done = sse_events(client.post("/v1/completions", json={**body, "stream": True}).text.splitlines())
            assert done == "[DONE]" and [t for c in chunks for t in c["choices"][0]["token_ids"]] == want.token_ids
            refused = client.post("/v1/completions", json={"model": "other", "prompt": PROMPT_IDS})
            assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
            wrong = client.post("/v1/completions", json={**body, "max_tokens": "many"})
            assert wrong.status_code == 422 and wrong.json()["error"]["param"] == "max_tokens"
            assert client.get("/health").json()["status"] == "ok"
            assert "paradecode_requests_total" in client.get("/metrics").text
    finally:
        serve.delete(APP_NAME)
