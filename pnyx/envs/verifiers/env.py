"""`VerifiersEnv`: a `verifiers` environment behind pnyx's `Environment` API.

`get_env("verifiers:<target>", pnyx={...adapter options}, **env_args)` imports the target (a module name,
`path/file.py`, a package folder, each optionally `:attr`), builds the verifiers env with `env_args`, and
picks a backend by what it built: a classic `vf.Environment` (`classic.py`) or a v1 `vf.Taskset`
(`v1.py`). pnyx generates with its own engine and episode loop (exact token ids, behaviour logprobs, tool
tokens masked); verifiers supplies the dataset rows, the tool replies (`respond`) and the rewards
(`score`), which the trainer recomputes from the task id and the decoded text, as for a native env.

Task ids are `verifiers:<slug>/<split>/<content hash>`: the hash of the row's identity (prompt, answer,
info), so they survive reordering the dataset; duplicate rows are one task and a row in both the dataset
and the eval dataset stays train-only (splits never overlap). Knows nothing about models, engines or the
trainer; verifiers' async calls run on one private event loop per process, each with a deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import json
import re
import signal
import sys
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from pnyx.envs.base import Environment, Score, Split, Task, check_split, split_of, zero
from pnyx.envs.dataset import seeded_order
from pnyx.envs.verifiers.classic import ClassicBackend
from pnyx.envs.verifiers.protocol import AdapterOptions, ReplayMismatch
from pnyx.envs.verifiers.v1 import V1Backend
from pnyx.errors import ConfigError

PREFIX = "verifiers:"
"""`--env.name` prefix that loads a verifiers environment."""
INSTALL_HINT = "pip install 'pnyx[verifiers]'"
T = TypeVar("T")


class _Loop:
    """One private event loop, on a daemon thread, for the verifiers calls of this process (pnyx's callers
    are synchronous; verifiers is async).

    A call past its deadline cannot be stopped (a synchronous reward function or tool blocks the loop, and
    `cancel` only reaches an await), so the loop it holds is abandoned: it stops once that call returns,
    and the next call gets a fresh loop. One slow or stuck completion therefore costs its own deadline and
    never delays, or zeroes, the honest ones after it. A loop whose thread died is replaced the same way."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None

    @classmethod
    def _current(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or cls._thread is None or not cls._thread.is_alive():
                cls._loop = asyncio.new_event_loop()
                cls._thread = threading.Thread(
                    target=cls._loop.run_forever, name="verifiers-loop", daemon=True
                )
                cls._thread.start()
            return cls._loop

    @classmethod
    def _abandon(cls, loop: asyncio.AbstractEventLoop) -> None:
        with cls._lock:
            if cls._loop is loop:
                cls._loop = cls._thread = None
        loop.call_soon_threadsafe(loop.stop)  # runs once the stuck call gives the loop back

    @classmethod
    def run(cls, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        loop = cls._current()
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            cls._abandon(loop)
            raise


def _require_verifiers() -> None:
    if importlib.util.find_spec("verifiers") is None:
        raise ConfigError(f"verifiers environments need the verifiers package: {INSTALL_HINT}")


def import_target(target: str) -> tuple[ModuleType, str | None]:
    """(module, attribute or None) of `pkg.mod[:attr]`, `path/file.py[:attr]` or `path/pkgdir[:attr]`."""
    spec, _, attr = target.partition(":")
    path = Path(spec)
    if spec.endswith(".py") or path.is_dir():
        file = path / "__init__.py" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"verifiers target {target!r}: no such file {file} (relative to {Path.cwd()})")
        name = "pnyx_vf_" + hashlib.blake2b(str(file.resolve()).encode(), digest_size=6).hexdigest()
        if name not in sys.modules:
            locations = [str(path)] if path.is_dir() else None
            mspec = importlib.util.spec_from_file_location(name, file, submodule_search_locations=locations)
            if mspec is None or mspec.loader is None:
                raise ConfigError(f"verifiers target {target!r}: {file} is not an importable Python file")
            module = importlib.util.module_from_spec(mspec)
            sys.modules[name] = module
            try:
                mspec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        return sys.modules[name], attr or None
    module_name = spec.replace("-", "_")
    try:
        return importlib.import_module(module_name), attr or None
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):
            raise  # the env module exists but one of its own imports is missing: show that
        raise ConfigError(
            f"verifiers target {target!r}: no module {module_name!r} (install the environment's package, e.g. "
            f"`prime env install` / `pip install`, or give a path to a .py file)"
        ) from None


def _slug(target: str) -> str:
    spec, _, attr = target.partition(":")
    stem = Path(spec).stem if spec.endswith(".py") else spec.rstrip("/").rsplit("/", 1)[-1].rsplit(".", 1)[-1]
    return re.sub(r"[^A-Za-z0-9_.-]", "-", stem + (f".{attr}" if attr else ""))[:64]


def _key(identity: Any) -> str:
    data = json.dumps(identity, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.blake2b(data.encode(), digest_size=8).hexdigest()


def _build_backend(
    module: ModuleType, attr: str | None, env_args: dict[str, Any], opts: AdapterOptions
) -> Any:
    """The backend of what the target names: `attr`, else `load_environment`, else the one `vf.Taskset`
    subclass in the module's `__all__`."""
    obj = getattr(module, attr, None) if attr else getattr(module, "load_environment", None)
    if attr and obj is None:
        raise ConfigError(f"verifiers target: module {module.__name__} has no attribute {attr!r}")
    taskset_base = _v1_taskset_class()
    if obj is None and taskset_base is not None:
        exported = [getattr(module, n, None) for n in getattr(module, "__all__", [])]
        found = [c for c in exported if isinstance(c, type) and issubclass(c, taskset_base)]
        obj = found[0] if len(found) == 1 else None
    if obj is None:
        raise ConfigError(
            f"verifiers target {module.__name__}: expected a load_environment(**kwargs) function or exactly one "
            "verifiers.v1 Taskset subclass in __all__ (or name one as path.py:attr)"
        )
    if taskset_base is not None and isinstance(obj, type) and issubclass(obj, taskset_base):
        from verifiers.v1 import TasksetConfig
        from verifiers.v1.utils.generic import concrete_type

        config_type = concrete_type(obj, TasksetConfig, origin=taskset_base) or TasksetConfig
        return V1Backend(obj(config_type(**env_args)), opts)
    with _own_signal_handlers():
        env = obj(**env_args)
    import verifiers as vf

    classic_base = getattr(vf, "Environment", None)
    if taskset_base is not None and isinstance(env, taskset_base):
        return V1Backend(env, opts)
    if isinstance(classic_base, type) and isinstance(env, classic_base):
        return ClassicBackend(env, opts)
    raise ConfigError(
        f"verifiers target {module.__name__}: {getattr(obj, '__name__', obj)} built a {type(env).__name__}, not "
        f"a verifiers Environment or Taskset (verifiers {getattr(vf, '__version__', '?')}; the classic API needs "
        "verifiers <= 0.3.x)"
    )


@contextmanager
def _own_signal_handlers() -> Iterator[None]:
    """Keep this process's SIGINT/SIGTERM handlers while a verifiers env is built.

    verifiers' classic `Environment.__init__` installs its own (teardown, then exit), which would replace
    pnyx's graceful stop, and raises off the main thread (`pnyx run` builds its evaluator's env on one).
    Its teardown still runs at exit (it also registers an `atexit` hook).
    """
    original = signal.signal
    signal.signal = lambda signalnum, handler: signal.getsignal(signalnum)  # type: ignore[assignment]
    try:
        yield
    finally:
        signal.signal = original


def _v1_taskset_class() -> type | None:
    try:
        from verifiers.v1 import Taskset
    except ImportError:
        return None
    return Taskset


class VerifiersEnv(Environment):
    """A `verifiers` environment (classic `load_environment()` or v1 `Taskset`) behind pnyx's API."""

    max_chars = 1 << 20  # score replays the whole episode; the base class would keep only the tail

    def __init__(self, target: str, pnyx: dict[str, Any] | None = None, **env_args: Any):
        _require_verifiers()
        self.opts = AdapterOptions.parse(pnyx)
        self.target = target
        self.name = PREFIX + _slug(target)
        module, attr = import_target(target)
        self.backend: ClassicBackend | V1Backend = _build_backend(module, attr, env_args, self.opts)
        self.part_names = self.backend.part_names
        self.max_turns = self.backend.max_turns
        self.tool_stops = self.backend.protocol.tool_stops
        self.stop_strings = list(self.opts.stop_strings)
        self.max_new_tokens = self.opts.max_new_tokens
        self._system_override: str | None = None
        self.rows: dict[str, dict[str, Any]] = self._split_rows()
        self.keys = {split: sorted(rows) for split, rows in self.rows.items()}
        first = next((self.rows[s][k] for s in ("train", "test") for k in self.keys[s]), None)
        if first is None:
            raise ConfigError(f"{self.name}: the verifiers env has no dataset rows")
        head = self.backend.prompt(first)
        self.system_prompt = head[0]["content"] if head and head[0]["role"] == "system" else ""

    def _split_rows(self) -> dict[str, dict[str, Any]]:
        """Rows by split and content key; splits never share a key (a shared row stays train-only)."""
        train, test = self.backend.datasets()
        rows: dict[str, dict[str, Any]] = {"train": {}, "test": {}}
        if test is None:
            for row in train:
                key = _key(self.backend.identity(row))
                rows[split_of(key, self.opts.test_fraction, salt=self.name)].setdefault(key, row)
            return rows
        for split, items in (("train", train), ("test", test)):
            for row in items:
                rows[split].setdefault(_key(self.backend.identity(row)), row)
        for key in set(rows["test"]) & set(rows["train"]):
            del rows["test"][key]
        return rows

    def configure(self, system_prompt: str | None = None, format_reward: float = 0.0) -> Environment:
        """As the base class; `system_prompt` replaces (or with "" drops) each row's own system message."""
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ConfigError(f'system_prompt must be a string ("" for none), got {system_prompt!r}')
        self._system_override = system_prompt
        return super().configure(system_prompt, format_reward)

    # --- the stream -------------------------------------------------------------------------

    def _prompt(self, row: Any) -> list[dict[str, str]]:
        messages = self.backend.prompt(row)
        if self._system_override is not None:
            messages = [m for m in messages if m["role"] != "system"]
            if self._system_override:
                messages = [{"role": "system", "content": self._system_override}, *messages]
        preamble = self.backend.protocol.preamble() if self.opts.tool_prompt else ""
        if preamble and messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": messages[0]["content"] + "\n\n" + preamble}, *messages[1:]]
        return [{"role": "system", "content": preamble}, *messages] if preamble else messages

    def _task(self, split: Split, key: str) -> Task:
        row = self.rows[split][key]
        return Task(
            id=f"{self.name}/{split}/{key}",
            prompt=self._prompt(row),
            answer=self.backend.answer(row),
            meta={"row": row},
        )

    def sample(self, split: Split, seed: int, n: int, start: int = 0) -> list[Task]:
        """Tasks `start..start+n-1`: the split's rows in a seeded order, reshuffled each pass (epoch)."""
        keys = self.keys[check_split(split)]
        if not keys:
            raise ConfigError(
                f"{self.name} has no {split} rows (set pnyx.test_fraction, or give the env more rows)"
            )
        orders: dict[int, list[int]] = {}
        out = []
        for i in range(start, start + n):
            epoch, j = divmod(i, len(keys))
            if epoch not in orders:
                orders[epoch] = seeded_order(len(keys), self.name, split, seed, epoch)
            out.append(self._task(split, keys[orders[epoch][j]]))
        return out

    def task(self, task_id: str) -> Task:
        prefix = f"{self.name}/"
        if not isinstance(task_id, str) or not task_id.startswith(prefix):
            raise ConfigError(f"task id {str(task_id)[:120]!r} is not a {self.name!r} task id")
        split, _, key = task_id[len(prefix) :].partition("/")
        if split not in self.rows or key not in self.rows[split]:
            raise ConfigError(f"task id {task_id!r}: no such row (is this process's dataset the worker's?)")
        return self._task(check_split(split), key)

    # --- scoring and tools ------------------------------------------------------------------

    def grade(self, task: Task, text: str) -> Score:
        try:
            reward, parts = _Loop.run(self.backend.score(task.meta["row"], text), self.opts.timeout_s)
        except ReplayMismatch as e:
            return zero(f"tool_reply_mismatch: {e}"[:200])
        except Exception as e:  # noqa: BLE001 - score never raises: a failing verifier is a zero with its reason
            return zero(f"verifiers_error: {type(e).__name__}: {e}"[:200])
        reward = self.opts.rescale(reward)
        return Score(reward=reward, parts=parts, reason=None if reward > 0 else "zero_reward")

    def respond(self, task: Task, text_so_far: str) -> str | None:
        """The env's reply to the call the text ends with (None: the env ends the episode). Raises
        `ReplayMismatch` when an earlier reply in the text is not the env's (the episode ends as a tool error)."""
        return _Loop.run(self.backend.respond(task.meta["row"], text_so_far), self.opts.timeout_s)

    def describe(self) -> str:
        return f"verifiers environment {self.target} ({self.backend.api} API)"
