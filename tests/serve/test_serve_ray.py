"""`confkv serve --ray`: the app as a Ray Serve deployment with 2 replicas on a local Ray (issue 34).

The same requests get the same greedy answers as `model.generate` through Ray Serve's proxy and router,
and both replicas serve. Starts a local Ray and Serve (slow on 2 cores): marked `ray`.
"""

import functools
import json
import socket
import threading
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("ray.serve")

import confkv  # noqa: E402
from confkv.config import StoreConfig  # noqa: E402
from confkv.hf import ConfKVCache, generate  # noqa: E402
from confkv.serve.ray_serve import deployment, tiny_llama  # noqa: E402

pytestmark = pytest.mark.ray

PROMPT = "The quick brown fox jumps over the lazy dog; then it naps. " * 2


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ray_served():
    import ray
    from ray import serve

    root = str(Path(confkv.__file__).resolve().parents[1])  # the workers import this checkout's confkv
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 runtime_env={"env_vars": {"PYTHONPATH": root, "OMP_NUM_THREADS": "1"}})
    except Exception as error:  # noqa: BLE001 - Ray gives its raylet 30 s to start; a loaded 2-core machine can miss it
        ray.shutdown()
        if "timed out during startup" not in str(error):
            raise
        pytest.skip(f"a local Ray did not start here: {error}")
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    settings = {"model_name": "tiny", "memory": 0.25, "chunk": 16, "max_batch": 4, "max_queue": 8}
    app = deployment(settings, replicas=2, loader=functools.partial(tiny_llama, 0.2), threads=1, num_cpus=0.5)
    serve.run(app, name="confkv", route_prefix="/", blocking=False)
    yield port
    serve.shutdown()
    ray.shutdown()


def test_two_replicas_answer_like_generate(ray_served):
    model, tokenizer = tiny_llama(0.2)
    ids = tokenizer.encode(PROMPT)
    cache = ConfKVCache.for_model(model, None, memory=0.25, store=StoreConfig(prefill_chunk=16))
    out = generate(model, torch.tensor([ids]), cache, chunk=16, max_new_tokens=24, do_sample=False)
    expected = out[0, len(ids):].tolist()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ray_served}/v1", api_key="none", max_retries=0, timeout=120)
    answers, streamed = [None] * 6, [None] * 6

    def ask(i):
        answers[i] = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
        chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
        streamed[i] = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for answer, tokens in zip(answers, streamed):
        assert answer.choices[0].model_extra["token_ids"] == expected
        assert tokens == expected
    # both replicas served: each replica's /metrics names its process and counts only its own requests
    completed = {}
    for _ in range(60):
        text = urllib.request.urlopen(f"http://127.0.0.1:{ray_served}/metrics", timeout=30).read().decode()
        pid = next(line.split('pid="')[1].split('"')[0] for line in text.splitlines()
                   if line.startswith("confkv_server_info"))
        completed[pid] = next(float(line.split()[-1]) for line in text.splitlines()
                              if line.startswith('confkv_requests_total{outcome="completed"}'))
        if len(completed) == 2:
            break
    assert len(completed) == 2 and sum(completed.values()) == 12 and min(completed.values()) > 0
    status = urllib.request.urlopen(f"http://127.0.0.1:{ray_served}/health", timeout=30)
    assert json.loads(status.read())["status"] == "ok"


def test_a_killed_replica_fails_its_requests_cleanly(ray_served):
    import os
    import signal
    import time

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ray_served}/v1", api_key="none", max_retries=0, timeout=120)
    ends = [None] * 4

    def ask(i):
        try:
            reason = None
            for chunk in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=600, temperature=0,
                                                   stream=True, extra_body={"confkv": {"ignore_eos": True}}):
                reason = chunk.choices[0].finish_reason or reason
            ends[i] = reason or "ended without a finish reason"
        except openai.APIError as error:
            ends[i] = f"error: {type(error).__name__}"

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    victim, deadline = None, time.monotonic() + 60
    while victim is None and time.monotonic() < deadline:  # a replica with requests in its batch
        text = urllib.request.urlopen(f"http://127.0.0.1:{ray_served}/metrics", timeout=30).read().decode()
        lines = text.splitlines()
        pid = next(line.split('pid="')[1].split('"')[0] for line in lines if line.startswith("confkv_server_info"))
        running = next(float(line.split()[-1]) for line in lines if line.startswith("confkv_running_requests "))
        if running >= 1:
            victim = int(pid)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a request hangs after its replica was killed"
    failed = [e for e in ends if e != "length"]
    assert failed and all(e.startswith("error") or e == "ended without a finish reason" for e in failed), ends
    # the service goes on: the other replica (and Ray's restarted one) answer
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert answer.choices[0].finish_reason == "length"
