"""The torch backend with torch.compile (`torch_compile=True`, `--compile`), on the CPU.

Inductor compiles every subgraph module; the tokens must be the eager modules' (the same reference as every
parity test: a divergence only at a reported near tie), ParaDecode's must be the compiled model's own ar in
every overlap, and the token and batch dimensions must be dynamic, so a new prompt length or proposal count
reuses the compiled code instead of compiling again, and a later process must reuse what an earlier one compiled
(Inductor's caches on disk). The GPU test (test_gpu.py) runs the same with CUDA graphs.
"""

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from paradecode.graphs.errors import UserInputError
from paradecode.runtime import load
from tests.parity import assert_same_tokens, export_scorer

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="torch.compile's CPU code generation needs a C++ compiler (g++), which this machine lacks",
)
PROMPT = [3, 1, 4, 1, 5]
NEW_TOKENS = 32
FAMILIES = ["llama", "gpt2"]  # rotary and grouped-query attention; learned positions and full heads


@pytest.fixture(scope="module")
def compiled_models(exports):
    """family -> the export loaded with the torch backend, its modules compiled; closed when the module ends."""
    models = {}

    def get(family):
        if family not in models:
            models[family] = load(exports[family][0], backend="torch", torch_compile=True)
        return models[family]

    yield get
    for model in models.values():
        model.close()


def compile_count() -> int:
    """The graphs dynamo has compiled in this process (every model's: read it before and after what is counted)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@contextmanager
def compiles_nothing(what: str) -> Iterator[None]:
    """Fail where the block compiles a graph, naming each function dynamo compiled again and the guards that failed
    (TORCH_LOGS=recompiles says the same), so that a failure says what changed, not only a count."""
    from torch._dynamo.utils import guard_failures

    before, seen = compile_count(), {code: len(reasons) for code, reasons in guard_failures.items()}
    yield
    failed = {
        f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})": reasons[seen.get(code, 0) :]
        for code, reasons in guard_failures.items()
        if len(reasons) > seen.get(code, 0)
    }
    more = compile_count() - before
    assert more == 0, f"{what} compiled {more} graph(s); the guards that failed: {failed}"


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_decoding_is_the_eager_modules(family, loaded, compiled_models):
    eager = loaded[family, "torch"]
    model = compiled_models(family)
    expected = eager.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, mode="ar", ignore_eos=True).token_ids
    ar = model.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, mode="ar", ignore_eos=True).token_ids
    score = export_scorer(eager)
    assert_same_tokens(ar, expected, f"{family} compiled ar vs eager ar", prompt=PROMPT, score=score)
    for overlap in ("batched", "streams", "both"):
        # threshold 0: every token exits at the first exit layer, its upper layers pending (random heads: most
        # roll back, where the model does not repeat one token)
        ours = model.generate(
            prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, thresholds=0.0, overlap=overlap, ignore_eos=True
        )
        assert sum(ours.stats.exits_per_layer.values()) > 0, "no token exited: no pending layers were tested"
        what = f"{family} compiled ParaDecode {overlap} vs compiled ar"
        assert_same_tokens(ours.token_ids, ar, what, prompt=PROMPT, score=score)


def test_other_lengths_reuse_the_compiled_code(exports, compiled_models):
    model = compiled_models("llama")
    model.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, thresholds=0.0, overlap="batched", ignore_eos=True)
    model.generate(prompt_ids=PROMPT * 3, max_new_tokens=8, thresholds=0.0, overlap="batched", ignore_eos=True)
    before = compile_count()
    # another prompt length, other verification widths (K = 3), another sequence: no new compilation
    model.generate(prompt_ids=PROMPT * 5, max_new_tokens=24, thresholds=0.0, max_unverified=3, ignore_eos=True)
    model.generate(prompt_ids=[7, 2], max_new_tokens=24, mode="ar", ignore_eos=True)
    assert compile_count() == before


def test_compiled_attention_reads_no_memory_a_new_cache_held(monkeypatch, loaded, compiled_models):
    """Compiled attention reads every cache slot, masked (a length read from the positions is not a shape Inductor
    plans for): a slot no position has written must hold 0, not whatever memory held (a NaN there leaks through the
    masked softmax as 0 x NaN). The allocator made to return NaN shows it; every cache starts at 0
    (runtime/kvcache.py)."""
    import torch

    from paradecode.graphs.tensors import HIDDEN, HIDDEN_OUT, PAST_KEY, PAST_VALUE, POSITIONS

    real_empty = torch.empty
    for backend in (compiled_models("llama").backend, loaded["llama", "torch"].backend):
        with monkeypatch.context() as patched:  # the allocation only: Inductor's own buffers need real memory
            patched.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
            cache = backend.allocate_cache()
        key, value = cache.layer(1)
        assert bool((key == 0).all()) and bool((value == 0).all())
        hidden = torch.randn(1, 2, backend.spec.hidden_size)
        feeds = {HIDDEN: hidden, POSITIONS: torch.arange(2)[None], PAST_KEY: key, PAST_VALUE: value}
        out = backend.run("layer_1", feeds, outputs=(HIDDEN_OUT,))[HIDDEN_OUT]
        assert not out.isnan().any(), f"compiled={backend.torch_compile}: NaN in the layer's output"


def test_a_warmed_up_model_compiles_nothing_more_for_the_same_kinds_of_call(exports, monkeypatch):
    """Counts dynamo's graphs (process-wide) around this model's calls. Its precondition is its own: dynamo's state is
    reset first (what earlier tests compiled, and the dimensions dynamo learned to make dynamic from them, are
    forgotten), so the warm-up alone decides what the later calls find compiled.

    The warm-up's calls must not depend on timing: it once measured costs in its first calls and let them decide its
    batch step's proposals, so where they declined (a loaded or slower CPU; here, whenever costs are known) it made no
    call of several rows of several positions, and the first batch of ParaDecode requests compiled the embedding, the
    segment and the final head again (3 graphs: seen in the full suite on an Intel CPU, and in reverse order here)."""
    import torch._dynamo

    from paradecode.runtime.engine import Engine, generate_batched
    from paradecode.runtime.speculation import Speculation

    proposals = Speculation.batch_proposals
    torch._dynamo.reset()
    with load(exports["qwen3"][0], backend="torch", torch_compile=True) as model:
        speculation = model.speculation
        batch = Engine(model.runtime, 2)
        at_start = compile_count()
        with monkeypatch.context() as patched:  # costs, once measured, decline every proposal of a batch step
            patched.setattr(
                Speculation, "batch_proposals", lambda s, a, src=None: 0 if s.times.known else proposals(s, a, src)
            )
            model.warm_up(engine=batch)
        assert compile_count() > at_start  # nothing was compiled since the reset
        assert model.speculation is speculation and speculation.times.layer.value is None  # it learned nothing
        assert len(model.shared_index) == 0
        with compiles_nothing("the lone calls after the warm-up"):
            model.generate(prompt_ids=PROMPT * 4, max_new_tokens=24, ignore_eos=True)  # the defaults: lookup
            model.generate(prompt_ids=[9, 8], max_new_tokens=12, thresholds=0.0, ignore_eos=True)
            model.generate(prompt_ids=PROMPT, max_new_tokens=12, thresholds=0.0, overlap="streams", ignore_eos=True)
        with compiles_nothing("plain decoding in a batch after the warm-up"):
            requests = [model.request(prompt_ids=p, max_new_tokens=12, mode="ar") for p in ([5, 6], [7, 8, 9])]
            generate_batched(model.runtime, requests, engine=batch)
        # ParaDecode in a batch, a request joining as another leaves: hidden states and positions are then views
        # at other offsets (each a guard to dynamo, unless made plain)
        monkeypatch.setattr(Speculation, "batch_proposals", lambda s, a, src=None: max(a, default=0))  # every proposal
        with compiles_nothing("ParaDecode in a batch after the warm-up"):
            prompts = ([5, 6], [7, 8, 9], [1, 2, 3, 4], [4], [5, 5, 5])
            requests = [model.request(prompt_ids=p, max_new_tokens=12, thresholds=0.0) for p in prompts]
            generate_batched(model.runtime, requests, 4)


def test_warm_up_fits_a_small_export(tmp_path, model_dirs):
    from paradecode.export.config import ExportConfig
    from paradecode.export.pipeline import export_model

    out = tmp_path / "small"
    export_model(ExportConfig(model=str(model_dirs["llama"]), output=out, max_seq_len=6))
    with load(out, backend="torch", torch_compile=True) as model:
        model.warm_up()  # prompt and new tokens sized to the 6 slots
        assert "full" not in model.runtime.notices._said  # the warm-up's tokens leave the user's warning for the user


def test_compile_on_a_cpu_without_a_cpp_compiler_is_refused_at_load(exports, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(UserInputError, match="needs a C\\+\\+ compiler"):
        load(exports["llama"][0], backend="torch", torch_compile=True)


def test_compile_needs_the_torch_backend(exports):
    with pytest.raises(UserInputError, match="torch_compile compiles the torch backend"):
        load(exports["llama"][0], backend="onnxruntime", torch_compile=True)


def test_serve_config_refuses_compile_without_torch(tmp_path):
    from paradecode.runtime.serve.config import ServeConfig

    with pytest.raises(UserInputError, match="backend torch"):
        ServeConfig(export=tmp_path, torch_compile=True)
    options = ServeConfig(export=tmp_path, backend="torch", torch_compile=True).model_options()
    assert options["torch_compile"] is True


# One process's compiled decoding: its tokens and the Inductor cache's hits and misses, as JSON on stdout's last line.
COMPILE_IN_A_PROCESS = """
import json, sys
from paradecode.runtime import load
from paradecode.runtime.backends.torch_backend import compile_cache_counts
with load(sys.argv[1], backend="torch", torch_compile=True) as model:
    tokens = model.generate(prompt_ids=[3, 1, 4, 1, 5], max_new_tokens=12, mode="ar", ignore_eos=True).token_ids
    print(json.dumps({"tokens": tokens, "folder": str(model.backend.compile_cache), **compile_cache_counts()}))
"""


def compile_in_a_process(export, env: dict) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_IN_A_PROCESS, str(export)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_second_process_reuses_what_the_first_compiled(exports, tmp_path):
    """Two processes compile the same export with no TORCHINDUCTOR_CACHE_DIR set: the first compiles into
    ~/.cache/paradecode/inductor, the second finds its graphs there (Inductor's FX graph cache hits) and decodes the
    same tokens."""
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME")}
    env["HOME"] = str(home)
    first = compile_in_a_process(exports["llama"][0], env)
    second = compile_in_a_process(exports["llama"][0], env)
    folder = home / ".cache" / "paradecode" / "inductor"
    assert first["folder"] == second["folder"] == str(folder)
    assert first["fx_graph_misses"] > 0 and first["fx_graph_hits"] == 0, first
    assert second["fx_graph_hits"] > 0, f"the second process compiled again: {second}"
    assert second["tokens"] == first["tokens"]


def test_a_cache_folder_the_user_set_is_kept_inductors_own_default_is_not(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from paradecode.runtime.backends import torch_backend

    ours = tmp_path / ".cache" / "paradecode" / "inductor"
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert torch_backend.use_compile_cache() == tmp_path / "mine"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert torch_backend.use_compile_cache() == ours
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(ours)
    # what Inductor writes into the environment at its first use (an export's tracing in the same process, say)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert torch_backend.use_compile_cache() == ours
