"""`confkv serve` on a tiny model, over loopback, called with the pinned `openai` client (issue 34).

Greedy answers equal `confkv.hf.generate` (model.generate after the chunked prefill) with the same cache
settings, streamed or not, alone or batched with a request of another memory target; a disconnect frees
the row; a full queue answers 429; a bad request 400 with the reason; /metrics' KV bytes are the caches'.
"""

import http.client
import json
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from confkv.config import StoreConfig  # noqa: E402
from confkv.hf import ConfKVCache, generate  # noqa: E402
from confkv.models import tiny_model, tiny_tokenizer  # noqa: E402
from confkv.serve.app import Server, create_app  # noqa: E402
from confkv.cli.serve import serve_in_thread  # noqa: E402

CHUNK = 16
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPT = "The quick brown fox jumps over the lazy dog; then it naps. " * 2  # 118 byte tokens: 8 prefill chunks


@pytest.fixture(scope="module")
def tiny():
    # larger initial weights than the default 0.02: greedy tokens then depend on what the cache kept
    model, tokenizer = tiny_model("llama", initializer_range=0.2), tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return model, tokenizer


class Running:
    """A server on 127.0.0.1 (a free port) in a background thread, with an openai client for it."""

    def __init__(self, model, tokenizer, **settings):
        self.server = Server(model, tokenizer, model_name="tiny", chunk=CHUNK, **settings)
        self.engine = self.server.engine
        self.uvicorn, self.thread, self.port = serve_in_thread(create_app(self.server))
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                                    timeout=60)

    def stop(self):
        self.uvicorn.should_exit = True
        self.thread.join(30)

    def get(self, path):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()

    def post(self, path, body):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.headers, response.read().decode()

    def metric(self, name):
        status, text = self.get("/metrics")
        assert status == 200
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def served(tiny):
    running = Running(*tiny, memory=0.25, max_batch=4)
    yield running
    running.stop()


def reference(model, ids, max_tokens, memory=0.25, policy=None, **params):
    """What `model.generate` gives with the same cache settings (the library's chunked-prefill generate)."""
    cache = ConfKVCache.for_model(model, policy, memory=memory, store=StoreConfig(prefill_chunk=CHUNK), **params)
    out = generate(model, torch.tensor([ids]), cache, chunk=CHUNK, max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(ids):].tolist(), cache


def token_ids(choice):
    return choice.model_extra["token_ids"]


def test_completion_equals_generate_streamed_or_not(served, tiny):
    model, tokenizer = tiny
    ids = tokenizer.encode(PROMPT)
    expected, cache = reference(model, ids, 40)
    full_bytes = 2 * 2 * 2 * 16 * 4 * (len(ids) + 39)  # K and V, 2 layers, 2 KV heads of 16 fp32 values
    assert cache.trace.peak_kv_bytes() < full_bytes / 2  # the target evicted: the test covers eviction
    answer = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0)
    assert token_ids(answer.choices[0]) == expected
    assert answer.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert answer.usage.completion_tokens == len(expected) and answer.usage.prompt_tokens == len(ids)
    streamed, text, reasons = [], "", []
    for chunk in served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                                  stream=True):
        streamed += token_ids(chunk.choices[0])
        text += chunk.choices[0].text
        reasons.append(chunk.choices[0].finish_reason)
    assert streamed == expected
    assert text == answer.choices[0].text
    assert reasons[-1] == answer.choices[0].finish_reason and set(reasons[:-1]) == {None}


def test_per_request_policy_and_memory_equal_generate(served, tiny):
    model, tokenizer = tiny
    ids = tokenizer.encode(PROMPT)
    expected, _ = reference(model, ids, 30, memory=0.5, policy="tova")
    answer = served.client.completions.create(model="tiny", prompt=ids, max_tokens=30, temperature=0,
                                              extra_body={"confkv": {"memory": 0.5, "policy": "tova"}})
    assert token_ids(answer.choices[0]) == expected
    default, _ = reference(model, ids, 30)
    assert default != expected  # the request's settings were used, not the server's


def test_chat_uses_the_template_and_equals_generate(served, tiny):
    model, tokenizer = tiny
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|assistant|>")
    expected, _ = reference(model, tokenizer.encode(text, add_special_tokens=False), 24)
    answer = served.client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    assert token_ids(answer.choices[0]) == expected
    assert answer.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    streamed, content = [], ""
    for chunk in served.client.chat.completions.create(model="tiny", messages=messages, max_tokens=24,
                                                       temperature=0, stream=True):
        streamed += token_ids(chunk.choices[0])
        content += chunk.choices[0].delta.content or ""
    assert streamed == expected and content == answer.choices[0].message.content


def test_seeded_sampling_equals_generate_with_the_seed(served, tiny):
    model, tokenizer = tiny
    ids = tokenizer.encode(PROMPT)
    cache = ConfKVCache.for_model(model, None, memory=0.25, store=StoreConfig(prefill_chunk=CHUNK))
    torch.manual_seed(1234)
    out = generate(model, torch.tensor([ids]), cache, chunk=CHUNK, max_new_tokens=30, do_sample=True,
                   temperature=0.9, top_p=0.8, top_k=0)
    expected = out[0, len(ids):].tolist()
    answers = [token_ids(served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30,
                                                          temperature=0.9, top_p=0.8, seed=1234).choices[0])
               for _ in range(2)]
    assert answers[0] == expected and answers[1] == expected
    other = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0.9,
                                             top_p=0.8, seed=99)
    assert token_ids(other.choices[0]) != expected


def test_stop_strings_end_the_text(served, tiny):
    model, tokenizer = tiny
    ids = tokenizer.encode(PROMPT)
    expected, _ = reference(model, ids, 40)
    full = tokenizer.decode(expected, skip_special_tokens=True)
    stop = full[10:13]
    answer = served.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stop=stop)
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].text == full[:full.find(stop)]
    streamed = "".join(c.choices[0].text for c in served.client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop], stream=True))
    assert streamed == answer.choices[0].text


def test_two_memory_targets_batched_each_equal_their_solo_runs(tiny):
    model, tokenizer = tiny
    ids = tokenizer.encode(PROMPT)
    settings = [{"memory": 0.2}, {"memory": 0.6, "policy": "h2o"}]
    solo = [reference(model, ids, 48, **s)[0] for s in settings]
    assert solo[0] != solo[1]
    rows_seen = []
    running = Running(model, tokenizer, memory=0.25, max_batch=4,
                      step_hook=lambda job: rows_seen.append(tuple(j.id for j in running.engine.running)))
    try:
        barrier, got = threading.Barrier(2), [None, None]

        def ask(i):
            barrier.wait()
            chunks = running.client.completions.create(model="tiny", prompt=ids, max_tokens=48, temperature=0,
                                                       stream=True, extra_body={"confkv": {**settings[i],
                                                                                           "ignore_eos": True}})
            got[i] = [t for c in chunks for t in token_ids(c.choices[0])]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        running.stop()
    assert max(len(rows) for rows in rows_seen) == 2  # both rows were in the running batch at once
    assert sum(len(rows) == 2 for rows in rows_seen) > 40  # for most of their steps, interleaved
    solo_full = [reference(model, ids, 48, **s)[0] for s in settings]
    assert solo_full == solo
    for i in range(2):
        expected = solo[i]
        assert got[i][:len(expected)] == expected  # ignore_eos may run past an EOS generate stops at


def test_a_failing_request_ends_with_an_error_and_the_others_go_on(tiny):
    model, tokenizer = tiny
    ids = tokenizer.encode(PROMPT)
    expected, _ = reference(model, ids, 30)

    def hook(job):
        if job.prompt[0] == ord("!") and len(job.tokens) == 3:
            raise RuntimeError("injected fault")

    running = Running(model, tokenizer, memory=0.25, max_batch=4, step_hook=hook)
    try:
        failures, got = [], []

        def bad():
            try:
                for _ in running.client.completions.create(model="tiny", prompt="!" + PROMPT, max_tokens=30,
                                                           temperature=0, stream=True):
                    pass
            except openai.APIError as error:
                failures.append(str(error))

        thread = threading.Thread(target=bad)
        thread.start()
        got = token_ids(running.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30,
                                                          temperature=0).choices[0])
        thread.join(60)
        # greedy, as the streamed request above: sampled at the default temperature, the tiny model ended with an
        # EOS before its third token in about one run of six, and the fault never came
        status, headers, body = running.post("/v1/completions", {"prompt": "!" + PROMPT, "max_tokens": 30,
                                                                 "temperature": 0})
        assert status == 500 and "injected fault" in json.loads(body)["error"]["message"]
        assert running.metric('confkv_requests_total{outcome="failed"}') == 2
    finally:
        running.stop()
    assert got == expected
    assert failures and "injected fault" in failures[0]


def test_a_disconnect_frees_the_row(tiny):
    model, tokenizer = tiny
    running = Running(model, tokenizer, memory=0.25, max_batch=2)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", running.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({
            "prompt": PROMPT, "max_tokens": 800, "stream": True, "temperature": 0, "confkv": {"ignore_eos": True}}),
            {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        for _ in range(3):  # a few tokens arrive
            assert response.readline().startswith(b"data: ")
            response.readline()
        assert len(running.engine.running) == 1
        job = running.engine.running[0]
        response.close()
        conn.sock.shutdown(2)
        conn.close()
        deadline = time.monotonic() + 20
        while running.engine.running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not running.engine.running
        assert running.engine.outcomes["cancelled"] == 1
        assert job.cache is None and len(job.tokens) < 400  # freed long before max_tokens
        assert running.metric("confkv_kv_bytes") == 0
        assert running.metric("confkv_running_requests") == 0
    finally:
        running.stop()


def test_a_full_queue_answers_429_with_retry_after(tiny):
    model, tokenizer = tiny
    running = Running(model, tokenizer, memory=0.25, max_batch=1, max_queue=1)
    results = []
    try:
        def ask():
            results.append(running.post("/v1/completions", {"prompt": "hi", "max_tokens": 4})[0])

        with running.engine.step_lock:  # the loop stops before its next step
            first = threading.Thread(target=ask)
            first.start()
            while len(running.engine.running) < 1:
                time.sleep(0.01)
            second = threading.Thread(target=ask)
            second.start()
            while running.engine.queue_depth < 1:
                time.sleep(0.01)
            status, headers, body = running.post("/v1/completions", {"prompt": "hi", "max_tokens": 4})
            assert status == 429
            assert int(headers["Retry-After"]) >= 1
            assert "queue is full" in json.loads(body)["error"]["message"]
            assert running.metric("confkv_queue_depth") == 1
            with pytest.raises(openai.RateLimitError):
                running.client.completions.create(model="tiny", prompt="hi", max_tokens=4)
        first.join(30)
        second.join(30)
        assert results == [200, 200]
        assert running.metric('confkv_requests_total{outcome="rejected"}') == 2
    finally:
        running.stop()


def test_bad_requests_answer_400_with_the_reason(served, tiny):
    model, _ = tiny
    with pytest.raises(openai.BadRequestError) as error:
        served.client.completions.create(model="tiny", prompt=[65] * 1100, max_tokens=4)
    assert "1024 positions" in str(error.value)
    with pytest.raises(openai.BadRequestError) as error:
        served.client.completions.create(model="tiny", prompt=[65] * 1000, max_tokens=100)
    assert "1024 positions" in str(error.value)
    # a memory target the cache cannot hold: the library's own message
    with pytest.raises(Exception) as library:
        ConfKVCache.for_model(model, memory=None, max_kv_bytes=100)
    status, _, body = served.post("/v1/completions", {"prompt": "hi", "confkv": {"max_kv_bytes": 100}})
    assert status == 400 and json.loads(body)["error"]["message"] == str(library.value)
    assert "cannot hold" in str(library.value)
    for confkv, reason in [({"memory": 1.5}, "must be a fraction"), ({"memory": "all"}, "must be a fraction"),
                           ({"policy": "nope"}, "nope"), ({"budget": 3}, "unknown setting")]:
        with pytest.raises(openai.BadRequestError) as error:
            served.client.completions.create(model="tiny", prompt="hi", max_tokens=4, extra_body={"confkv": confkv})
        assert reason in str(error.value), confkv
    for body, reason in [({"prompt": ""}, "empty"), ({"prompt": "hi", "temperature": -1}, "temperature"),
                         ({"prompt": "hi", "n": 2}, "n"), ({"prompt": "hi", "stop": 3}, "stop"),
                         ({"prompt": [[1, 2], [3]]}, "one prompt")]:
        status, _, text = served.post("/v1/completions", body)
        assert status == 400 and reason in json.loads(text)["error"]["message"], body


def test_metrics_kv_bytes_equal_the_caches(tiny):
    model, tokenizer = tiny
    running = Running(model, tokenizer, memory=0.25, max_batch=4)
    streams = []
    try:
        for memory in (0.25, 0.5):
            conn = http.client.HTTPConnection("127.0.0.1", running.port, timeout=30)
            conn.request("POST", "/v1/completions", json.dumps({
                "prompt": PROMPT, "max_tokens": 400, "stream": True, "confkv": {"memory": memory, "ignore_eos": True}}),
                {"Content-Type": "application/json"})
            streams.append((conn, conn.getresponse()))
        for _, response in streams:
            for _ in range(5):
                response.readline()
                response.readline()
        with running.engine.step_lock:  # between two steps
            jobs = list(running.engine.running)
            assert len(jobs) == 2
            held = sum(job.cache.kv_bytes() for job in jobs)
            assert held > 0
            assert running.metric("confkv_kv_bytes") == held
            assert running.metric("confkv_running_requests") == 2
            _, text = running.get("/metrics")
            for job in jobs:
                assert f'confkv_running_request_kv_bytes{{request="{job.id}"}} {job.cache.kv_bytes()}' in text
                peak = job.cache.trace.peak_kv_bytes()
                assert f'confkv_running_request_peak_kv_bytes{{request="{job.id}"}} {peak}' in text
            targets = sum(job.cache.last_plan.target_bytes for job in jobs)
            assert running.metric("confkv_kv_target_bytes") == targets
            assert held <= targets
            assert running.metric("confkv_generated_tokens_total") >= 10
    finally:
        for conn, _ in streams:
            conn.close()
        running.stop()


def test_models_health_and_shutdown_drains(tiny):
    model, tokenizer = tiny
    running = Running(model, tokenizer, memory=0.25, max_batch=2)
    models = running.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert running.get("/health")[0] == 200
    chunks = running.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=60, temperature=0,
                                               stream=True, extra_body={"confkv": {"ignore_eos": True}})
    first = next(iter(chunks))
    running.uvicorn.should_exit = True  # shutdown starts while the request runs
    rest = list(chunks)
    running.thread.join(30)
    assert not running.thread.is_alive()
    tokens = token_ids(first.choices[0]) + [t for c in rest for t in token_ids(c.choices[0])]
    assert len(tokens) == 60 and rest[-1].choices[0].finish_reason == "length"
    assert running.engine.outcomes["completed"] == 1


def test_the_serve_subcommand_is_registered(capsys):
    from confkv.cli import main

    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--memory" in out and "127.0.0.1" in out


def test_the_load_generator_counts_every_request(tiny):
    from confkv.eval.bench.serve_load import run_load
    from confkv.eval.bench.serve_results import summary_lines

    model, tokenizer = tiny
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(34, 250, (int(n),), generator=gen).tolist() for n in (20, 45, 60, 33, 50, 28)]
    prompts[2][0] = 33  # this one fails after its first token
    prompts[4][0] = 32  # this one the server drops after 3 tokens: its stream ends without a finish reason
    news = [5, 9, 7, 12, 6, 10]

    def hook(job):
        if job.prompt[0] == 33 and len(job.tokens) == 1:
            raise RuntimeError("injected fault")
        if job.prompt[0] == 32 and len(job.tokens) == 2:
            job.cancel()

    running = Running(model, tokenizer, memory=0.25, max_batch=3, step_hook=hook)
    try:
        result = run_load(f"http://127.0.0.1:{running.port}", prompts, news, clients=3, memory=0.25, timeout=60,
                          log=lambda line: None)
    finally:
        running.stop()
    assert (result["completed"], result["failed"], result["lost"]) == (4, 1, 1)
    # the dropped one: cancelled in the hook before its 3rd token's forward, it leaves at the next step
    assert result["generated_tokens"] == sum(news) - news[2] + 1 - news[4] + 3
    assert result["server_generated_tokens"] == result["generated_tokens"]
    assert result["ttft_p50_s"] > 0 and result["itl_p99_s"] >= result["itl_p50_s"] > 0
    assert 0 < result["peak_kv_bytes"] <= result["target_bytes_at_peak"]
    assert "completed 4, failed 1, lost 1" in summary_lines(result)[0]


def test_the_load_generator_samples_the_servers_rss_as_requests_end(tiny):
    import os

    from confkv.eval.bench.serve_load import run_load
    from confkv.eval.bench.serve_results import flat_memory, summary_lines

    model, tokenizer = tiny
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(34, 250, (int(n),), generator=gen).tolist() for n in (20, 45, 33, 50, 28)]
    running = Running(model, tokenizer, memory=0.25, max_batch=2)
    try:  # the server runs in this process: its RSS is this process's
        result = run_load(f"http://127.0.0.1:{running.port}", prompts, [4, 6, 5, 3, 7], clients=2, memory=0.25,
                          timeout=60, server_pid=os.getpid(), log=lambda line: None)
    finally:
        running.stop()
    samples = result["rss_by_requests"]
    assert [n for n, _ in samples] == [1, 2, 3, 4, 5] and all(rss > 2**20 for _, rss in samples)
    result["flat_memory"] = flat_memory(result, 2)
    assert result["flat_memory"]["rss_after"] == samples[1][1] and result["flat_memory"]["last"] == 5
    assert "server RSS after 2 requests" in summary_lines(result)[-1]


def test_the_load_generator_speaks_to_a_text_only_server(tiny):
    from confkv.eval.bench.serve_load import run_load
    from confkv.eval.bench.serve_peer import server_command, text_request

    model, tokenizer = tiny
    text = text_request(tokenizer)
    assert text["extra_body"] == {"logit_bias": {str(tokenizer.eos_token_id): -100.0}}
    ids = tokenizer("Hello there, a prompt.")["input_ids"]
    assert text["decode"](ids) == tokenizer.decode(ids)
    running = Running(model, tokenizer, memory=0.25, max_batch=2)
    try:  # ours takes text prompts too (and ignores the peer's logit_bias): every request completes
        result = run_load(f"http://127.0.0.1:{running.port}", [ids, ids[:5]], [6, 4], clients=2, memory=0.25,
                          timeout=60, log=lambda line: None, text=text)
    finally:
        running.stop()
    assert (result["completed"], result["lost"]) == (2, 0) and 0 < result["generated_tokens"] <= 10
    assert result["peak_kv_bytes"] is None  # a peer has no confkv metrics: none are read
    command = server_command("m.gguf", 8123, 2, 4416)
    assert command[1:3] == ["-m", "llama_cpp.server"] and command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--n_threads") + 1] == "2" and command[command.index("--n_ctx") + 1] == "4416"
    assert command[command.index("--interrupt_requests") + 1] == "False"  # a waiting request must not cut a stream


def test_requests_past_the_deadline_are_not_sent_and_not_lost(tiny):
    from confkv.eval.bench.serve_load import run_load
    from confkv.eval.bench.serve_results import summary_lines

    model, tokenizer = tiny
    running = Running(model, tokenizer, memory=0.25, max_batch=2)
    try:
        result = run_load(f"http://127.0.0.1:{running.port}", [[40, 41, 42]] * 3, [2, 2, 2], clients=2, memory=0.25,
                          timeout=60, max_seconds=0.0, log=lambda line: None)
    finally:
        running.stop()
    assert (result["completed"], result["lost"], result["not_sent"]) == (0, 0, 3)
    assert "not sent 3 (past --max-seconds)" in summary_lines(result)[0]


def test_two_runs_of_a_load_compare_their_answers_request_by_request(tiny):
    from confkv.eval.bench.serve_load import run_load
    from confkv.eval.bench.serve_results import same_answers

    model, tokenizer = tiny
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(34, 250, (int(n),), generator=gen).tolist() for n in (20, 45, 33, 50)]
    news = [5, 7, 4, 6]
    runs = []
    for max_batch in (1, 3):  # one at a time, then batched: greedy answers must not change
        running = Running(model, tokenizer, memory=0.25, max_batch=max_batch)
        try:
            runs.append(run_load(f"http://127.0.0.1:{running.port}", prompts, news, clients=3, memory=0.25,
                                 timeout=60, log=lambda line: None))
        finally:
            running.stop()
    solo, batched = runs
    assert sorted(o["index"] for o in solo["outcomes"]) == [0, 1, 2, 3]
    assert all(len(o["token_ids"]) == o["tokens"] == news[o["index"]] for o in solo["outcomes"])
    assert same_answers(batched, solo) == {"compared": 4, "equal": 4, "different": []}
    changed = next(o for o in batched["outcomes"] if o["index"] == 2)
    changed["token_ids"][-1] += 1
    assert same_answers(batched, solo) == {"compared": 4, "equal": 3, "different": [2]}
    changed["status"] = "failed"  # only requests both runs completed are compared
    assert same_answers(batched, solo)["compared"] == 3


def test_answers_are_compared_only_between_runs_of_the_same_load():
    from confkv.eval.bench.serve_load import build_parser
    from confkv.eval.bench.serve_results import comparable

    parser = build_parser()
    args = parser.parse_args(["--requests", "8", "--seed", "3", "--ray"])
    earlier = {"command": "python -m confkv.eval.bench.serve_load --requests 8 --seed 3 --threads 2",
               "outcomes": [{"token_ids": [5, 6]}]}
    assert comparable(earlier, args, parser) is None  # threads and --ray are how it is served, not what is asked
    assert "--seed 4" in comparable(dict(earlier, command=earlier["command"].replace("3", "4")), args, parser)
    assert "--memory 0.5" in comparable(dict(earlier, command=earlier["command"] + " --memory 0.5"), args, parser)
    assert "no answers" in comparable(dict(earlier, outcomes=[{"token_ids": []}]), args, parser)
    assert "not the JSON of a serve_load run" in comparable({"outcomes": []}, args, parser)


def test_a_stopped_load_sends_no_more_and_counts_the_running_requests(tiny):
    import threading

    from confkv.eval.bench.serve_load import run_load
    from confkv.eval.bench.serve_results import summary_lines

    model, tokenizer = tiny
    stop = threading.Event()
    logged = []

    def log(line):  # the first request to end stops the load (as Ctrl-C would): the other running one finishes
        logged.append(line)
        stop.set()

    running = Running(model, tokenizer, memory=0.25, max_batch=2)
    try:
        result = run_load(f"http://127.0.0.1:{running.port}", [[40, 41, 42, 43]] * 6, [3, 12, 3, 3, 3, 3], clients=2,
                          memory=0.25, timeout=60, log=log, stop=stop)
    finally:
        running.stop()
    assert (result["completed"], result["lost"], result["not_sent"]) == (2, 0, 4)  # both sent ones answered in full
    assert result["generated_tokens"] == 15 and len(logged) == 2
    result["stopped_by"] = "SIGINT"
    assert "not sent 4 (stopped by SIGINT)" in summary_lines(result)[0]


def test_flat_memory_compares_rss_after_n_requests_with_the_last():
    from confkv.eval.bench.serve_results import flat_memory

    result = {"rss_by_requests": [[1, 900], [2, 1000], [3, 1020], [4, 1030]]}
    assert flat_memory(result, 2) == {"after": 2, "rss_after": 1000, "last": 4, "rss_last": 1030,
                                      "growth": pytest.approx(0.03)}
    assert flat_memory(result, 4) is None  # nothing after the 4th to compare
    assert flat_memory({"rss_by_requests": []}, 1) is None


@pytest.mark.filterwarnings("ignore:confkv. NaN logits")
def test_nan_logits_end_that_request_with_an_error(tiny):
    model, tokenizer = tiny
    poisoned = {"on": False}

    def nan_head(module, inputs, output):
        return torch.full_like(output, float("nan")) if poisoned["on"] else output

    handle = model.get_output_embeddings().register_forward_hook(nan_head)
    running = Running(model, tokenizer, memory=0.25, max_batch=2,
                      step_hook=lambda job: poisoned.update(on=job.prompt[0] == ord("?")))
    try:
        status, _, body = running.post("/v1/completions", {"prompt": "?" + PROMPT, "max_tokens": 5})
        assert status == 500 and "NaN logits" in json.loads(body)["error"]["message"]
        answer = running.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0)
        assert answer.choices[0].finish_reason == "length" and len(token_ids(answer.choices[0])) == 5
    finally:
        running.stop()
        handle.remove()


def test_a_row_that_leaves_the_running_list_has_left_the_totals_already(tiny):
    """The engine's totals (read by /metrics without a lock) are brought up to date before a finished or cancelled
    row leaves ``running``: a reader that sees the row gone never sees its KV bytes or its target still counted."""
    from confkv.serve.engine import Engine, Job

    model, _ = tiny
    engine = Engine(model, chunk=CHUNK, max_batch=2)
    seen = []

    class Checked(list):
        def remove(self, job):
            rest = [j for j in self if j is not job]
            seen.append((engine.kv_bytes_held == sum(j.kv_bytes for j in rest),
                         engine.target_bytes_held == sum(j.target_bytes for j in rest),
                         job.kv_bytes == job.target_bytes == 0 and job.cache is None))
            super().remove(job)

    engine.running = Checked()
    done = threading.Event()
    finished = []

    def emit(kind, payload):
        if kind != "token":
            finished.append(payload)
            if len(finished) == 2:
                done.set()

    ids = list(range(3, 40))
    jobs = [Job(prompt=ids, cache=ConfKVCache.for_model(model, memory=0.25), max_tokens=6, emit=emit),
            Job(prompt=ids, cache=ConfKVCache.for_model(model, memory=0.5), max_tokens=400, emit=emit)]
    engine.start()
    try:
        for job in jobs:
            engine.submit(job)
        deadline = time.monotonic() + 60
        while len(jobs[1].tokens) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        jobs[1].cancel()
        assert done.wait(60)
    finally:
        engine.stop(drain=False, timeout=30)
    assert sorted(finished) == ["cancelled", "length"]
    assert seen == [(True, True, True)] * 2
