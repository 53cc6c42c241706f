"""Carries out one command on one engine and turns the outcome into an ack.

Kept apart from the bus so the command logic reads as plain async code: the
agent's command queue (:mod:`lorabus.agents.command_queue`) feeds commands in,
one at a time and in order, and publishes what comes out. Commands are
idempotent: a pause of a paused engine, a load of a loaded name and an unload
of a name the engine lacks all succeed.

A command is trusted no further than this host can check it: before any engine
call, its served names must follow the coordinator's rule (``bad_request``
otherwise) and a load's path is checked on this host (``load_source.py``).
The refusing ack is the record of it, on the worker's own ack subject. An
adapter from the fleet's object store (a ``bus:<digest>`` path) is fetched
into this node's cache and the engine is handed the cached directory; a
``prepare`` does the fetch alone, ahead of the update's pause
(:mod:`~lorabus.agents.store_loads`). Before a fetch and after every command
the node's cache is told which entries the engine may serve or a load needs,
so that no prune on the node removes them; pruning itself runs beside the
agent, never inside a command: a good load is never failed by housekeeping.

An engine may be unable to take LoRA updates at all, however often asked (a
vLLM started without its runtime LoRA routes, an SGLang with data
parallelism): the executor asks its driver (:class:`SetupCheck`) at start,
then at every check while a problem is known (so a fixed engine is seen
within a beat), every ``SETUP_RECHECK_S`` otherwise, and after a command
failed for good. While there is one, :attr:`CommandExecutor.setup_problem`
says what and how to fix it, and the agent reports its worker not ready.

An engine may also drop adapters on its own to make room for a load (SGLang
with ``--max-loaded-loras`` unloads the least recently used one). A load
after which the engine no longer lists an adapter's committed version, which
it listed before, fails, saying so: the update that caused it reports it, and
the agent, now lacking what the fleet serves, is not ready until it has
loaded it again (:mod:`~lorabus.agents.convergence`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from lorabus.agents.adapter_cache import AdapterCache
from lorabus.agents.adapter_paths import check_served_name
from lorabus.agents.cache_holders import CacheKeeper
from lorabus.agents.capacity import capacity_of, dropped_text, room_for
from lorabus.agents.engine import CacheReset, EngineDriver, InPlaceReplace, SetupCheck
from lorabus.agents.load_source import checked_dir, refuse_other_bytes, seen_digest
from lorabus.agents.pending_pause import PendingPause
from lorabus.agents.store_loads import StoreLoads
from lorabus.errors import (
    BadRequest,
    CanaryFailed,
    DigestMismatch,
    EngineError,
    LorabusError,
    NotListed,
)
from lorabus.runtime.clock import now
from lorabus.schemas import (
    Ack,
    CanaryCommand,
    ErrorCode,
    ErrorInfo,
    LoadCommand,
    PauseCommand,
    PhasedCommand,
    PrepareCommand,
    ResumeCommand,
    UnloadCommand,
    WorkerRole,
    phase_of,
)

log = logging.getLogger(__name__)

SETUP_RECHECK_S = 30.0
"""How often an engine without a known set-up problem is asked again: one
restarted without a flag shows within this (or at its first failed command)."""


class CommandExecutor:
    """Runs commands against one engine and remembers what it last saw of it."""

    def __init__(
        self,
        worker_id: str,
        world_size: int,
        driver: EngineDriver,
        *,
        adapter_roots: list[str] | None = None,
        adapter_cache: AdapterCache | None = None,
        cache_keeper: CacheKeeper | None = None,
        pending_pause: PendingPause | None = None,
        max_adapters: int = 0,
        role: WorkerRole = WorkerRole.AGGREGATED,
    ) -> None:
        """``adapter_cache``, ``cache_keeper``: for loads from the fleet's
        object store (:class:`~lorabus.agents.store_loads.StoreLoads`).
        ``pending_pause``: where a pause in
        flight is recorded for a successor (None: nowhere). ``max_adapters``:
        the most adapters the engine holds at once (0: as it says itself)."""
        self.worker_id = worker_id
        self.adapter_roots = list(adapter_roots or [])
        """Directories adapters may be loaded from, on this host (empty: any path,
        passed to the engine unchecked)."""
        self.world_size = world_size
        self.role = role
        """What the worker does in serving (its heartbeat says it)."""
        self.driver = driver
        self.paused = False
        self.maybe_paused = False
        """A pause went unanswered: the engine may pause late, after a resume."""
        self.pending_pause = pending_pause
        self.max_adapters = max_adapters
        self.spare: Callable[[list[str]], list[str]] = lambda held: []
        """Which of the held names the engine may give up to make room,
        oldest first (the agent's convergence sets it: old versions nothing
        keeps)."""
        self._seen_digest = ""
        """The digest the load being run saw (for its ack)."""
        self._adapters: list[str] = []
        self._listed = False
        """The engine's list has been read: :attr:`adapters` is what it holds."""
        self.last_contact = 0.0
        """When a command last talked to the engine (monotonic seconds)."""
        self.store_loads = StoreLoads(worker_id, adapter_cache, cache_keeper)
        """Loads from the fleet's object store, through this node's cache (the
        agent's connection sets its ``fetch``)."""
        self.committed_names: frozenset[str] = frozenset()
        """Each adapter's committed served name, as the agent last learnt them:
        a load must not make the engine drop one."""
        self.dropped_committed: list[str] = []
        """The committed names the last command's load made the engine drop
        (it fails, saying so)."""
        self.setup_problem = ""
        """What keeps the engine from taking LoRA updates and how to fix it, as
        the driver last found ("": nothing known)."""
        self._setup_checked_at: float | None = None
        """When the driver last answered the set-up check (None: ask at once)."""

    @property
    def adapters(self) -> list[str]:
        """The engine's adapter list, as last read back."""
        return self._adapters

    @adapters.setter
    def adapters(self, names: list[str]) -> None:
        self._adapters = names
        self._listed = True

    @property
    def capacity(self) -> int | None:
        """The most adapters the engine holds at once (None: not bounded as
        far as this agent knows; :mod:`lorabus.agents.capacity`)."""
        return capacity_of(self.max_adapters, getattr(self.driver, "capacity", None))

    @property
    def data_parallel(self) -> int:
        """The data-parallel ranks behind the engine server, as the driver
        found at its set-up check (1 where it knows of none)."""
        ranks = getattr(self.driver, "data_parallel", 1)
        return ranks if isinstance(ranks, int) and ranks >= 1 else 1

    async def refresh(self) -> None:
        """Read the engine's adapter list (at start, so heartbeats tell the
        truth), and first, when due, whether it can take LoRA updates."""
        if self._setup_due():
            await self.check_setup()
        self.adapters = await self.driver.list_adapters()
        self._hold()

    async def check_setup(self) -> None:
        """Ask the driver what keeps the engine from taking LoRA updates; an
        engine that does not answer leaves what was found last."""
        if not isinstance(self.driver, SetupCheck):
            return
        try:
            problem = await self.driver.setup_problem() or ""
        except EngineError as exc:
            log.debug("worker=%s set-up check got no answer: %s", self.worker_id, exc)
            return
        self._setup_checked_at = now()
        if problem and problem != self.setup_problem:
            log.warning("worker=%s engine cannot take LoRA updates: %s", self.worker_id, problem)
        elif self.setup_problem and not problem:
            log.info("worker=%s engine can take LoRA updates now", self.worker_id)
        self.setup_problem = problem

    def _setup_due(self) -> bool:
        checked = self._setup_checked_at
        return bool(self.setup_problem) or checked is None or now() - checked >= SETUP_RECHECK_S

    async def execute(
        self,
        command: PhasedCommand,
        budget_s: float,
        *,
        retire: bool = False,
        shared_pause: bool = False,
    ) -> Ack:
        """Run ``command`` within ``budget_s`` seconds and return its ack.

        ``retire``: an unload of versions the last read-back listed, done with
        one call per name and no read-back (the engine's list is refreshed
        only if a call fails). ``shared_pause``: another update of its round
        holds the engine paused, so a pause of a paused engine does not ask it
        again, and a resume leaves it paused; both succeed.
        """
        started = now()
        error: ErrorInfo | None = None
        self._seen_digest = ""
        self.dropped_committed = []
        try:
            async with asyncio.timeout(max(budget_s, 0.0)):
                await self._run(command, budget_s, retire=retire, shared_pause=shared_pause)
        except TimeoutError:
            error = ErrorInfo(
                code=ErrorCode.PHASE_TIMEOUT,
                message=f"{phase_of(command)} on {self.worker_id} did not finish "
                f"within its budget of {budget_s:.1f}s",
            )
        except LorabusError as exc:
            error = exc.info()
            if isinstance(exc, EngineError) and not exc.retryable:
                self._setup_checked_at = None  # perhaps restarted without a flag: ask
        except Exception as exc:
            # A bug must cost one failed ack, not the agent: the engine may be
            # paused, and only a live agent can still resume it.
            log.exception("worker=%s update=%s command crashed", self.worker_id, command.update_id)
            error = ErrorInfo(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}")
        self.last_contact = now()
        self._hold()
        if error is not None:
            log.warning(
                "worker=%s update=%s epoch=%d %s: %s",
                self.worker_id,
                command.update_id,
                command.epoch,
                error.code,
                error.message,
            )
        return Ack(
            update_id=command.update_id,
            phase=phase_of(command),
            worker_id=self.worker_id,
            ok=error is None,
            world_size=self.world_size,
            adapters=list(self.adapters),
            paused=self.paused or self.maybe_paused,
            error=error,
            duration_s=now() - started,
            epoch=command.epoch,
            digest=self._seen_digest,
        )

    async def resume_unasked(self) -> None:
        """Resume the engine outside any command: at an agent's start (a
        predecessor may have died with it paused) and on its way out."""
        await self.driver.resume()
        self.paused = False

    def _pause_answered(self) -> None:
        if self.pending_pause is not None:
            self.pending_pause.answered()

    def late_pause_undone(self) -> None:
        """A resume ran after the lease of an unanswered pause ran out: a pause
        that landed late is undone, and no other can land now."""
        self.maybe_paused = False

    def refusal(self, command: PhasedCommand, error: ErrorInfo) -> Ack:
        """The failed ack of ``command``, refused before it reached the engine,
        with what this executor last saw of the engine."""
        return Ack(
            update_id=command.update_id,
            phase=phase_of(command),
            worker_id=self.worker_id,
            ok=False,
            world_size=self.world_size,
            adapters=list(self.adapters),
            paused=self.paused or self.maybe_paused,
            error=error,
            epoch=command.epoch,
        )

    async def _run(
        self, command: PhasedCommand, budget_s: float, *, retire: bool, shared_pause: bool
    ) -> None:
        match command:
            case PrepareCommand(digest=digest, path=path):
                store = self.store_loads.stored(path)[0]
                self.store_loads.prepared(digest, self._listed_names())
                await self.store_loads.fetched(store, digest, budget_s)
                self._seen_digest = digest  # verified by the cache before it was handed out
            case PauseCommand() | ResumeCommand() if shared_pause and self.paused:
                pass  # another update of its round holds the engine paused
            case PauseCommand():
                if self.pending_pause is not None:
                    # For a successor, should this process die now.
                    self.pending_pause.sent(command.lease_s)
                try:
                    await self.driver.pause()
                except BaseException as exc:
                    # No answer (a timeout, a transport error, the budget ran
                    # out): the engine may still carry the pause out later.
                    if not (isinstance(exc, EngineError) and exc.status is not None):
                        self.maybe_paused = True
                        raise
                    self._pause_answered()
                    raise
                self._pause_answered()
                self.paused = True
            case ResumeCommand():
                await self.driver.resume()
                self.paused = False
            case LoadCommand(served_name=name, path=path, replace=replace, digest=asked):
                self._check_names([name])
                store, stored = self.store_loads.stored(path)
                if stored is not None:
                    await self._load_stored(
                        name, store, stored, asked, replace=replace, budget_s=budget_s
                    )
                    return
                real = await checked_dir(
                    path, self.adapter_roots, self.worker_id, command.update_id
                )
                if asked is not None:
                    await self._check_digest(real, asked)  # before anything is loaded
                    await self._load(name, real, replace=replace, budget_s=budget_s)
                    return
                # Only the ack needs the digest: hash while the engine loads, so
                # reading a large adapter twice does not add to the load phase.
                hashing = asyncio.create_task(self._check_digest(real, None))
                try:
                    await self._load(name, real, replace=replace, budget_s=budget_s)
                except BaseException:
                    # A failed or timed-out load must not wait for a slow read:
                    # the resume may be queued behind it. (The thread finishes alone.)
                    hashing.cancel()
                    await asyncio.gather(hashing, return_exceptions=True)
                    raise
                await hashing  # under the command's budget, like the load
            case CanaryCommand(served_name=name):
                self._check_names([name])
                try:
                    await self.driver.canary(name, budget_s=budget_s)
                except EngineError as exc:
                    raise CanaryFailed(
                        f"{self.worker_id} did not answer a generation as {name!r}: {exc}",
                        status=exc.status,
                    ) from exc
            case UnloadCommand(names=names) if retire:
                self._check_names(names)
                await self._retire(names)
            case UnloadCommand(names=names):
                self._check_names(names)
                await self._unload(names)

    async def _load_stored(
        self,
        name: str,
        store: str,
        digest: str,
        asked: str | None,
        *,
        replace: bool,
        budget_s: float,
    ) -> None:
        if asked is not None and asked != digest:
            raise DigestMismatch(f"{self.worker_id} was asked to load {digest} as {asked}: refused")
        with self.store_loads.loading(name, digest, self._listed_names()):
            started = now()
            real = await self.store_loads.fetched(store, digest, budget_s)
            self._seen_digest = digest  # verified by the cache before it was handed out
            await self._load(name, real, replace=replace, budget_s=budget_s - (now() - started))

    def _listed_names(self) -> list[str] | None:
        """The engine's adapter list, None until it has been read."""
        return self._adapters if self._listed else None

    def _hold(self) -> None:
        """Tell the node's cache what the engine may serve from it (never fails
        a command)."""
        self.store_loads.hold(self._listed_names())

    def _check_names(self, names: list[str]) -> None:
        """Refuse the command if a name could leave its place in an engine URL."""
        for name in names:
            try:
                check_served_name(name)
            except ValueError as exc:
                raise BadRequest(f"{self.worker_id} refused the command: {exc}") from exc

    async def _check_digest(self, path: str, asked: str | None) -> None:
        """Hash what this host shows at ``path`` (the ack says it, also when
        the load is refused for it), and refuse other bytes than asked for."""
        self._seen_digest = await seen_digest(path, asked, self.worker_id)
        refuse_other_bytes(self._seen_digest, asked, path, self.worker_id)

    async def _make_room(self, name: str) -> None:
        """At capacity, unload the oldest versions nothing keeps before
        loading ``name`` (NoCapacity when that is not enough)."""
        if spare := room_for(name, self.adapters, self.capacity, self.spare, self.worker_id):
            await self._unload(spare)

    async def _load(self, name: str, path: str, *, replace: bool, budget_s: float) -> None:
        await self._make_room(name)
        before = set(self.adapters)
        held = sorted(n for n in self.committed_names if n != name and n in before)
        in_place = replace and name in await self.driver.list_adapters()
        if in_place and not isinstance(self.driver, InPlaceReplace):
            # Dynamo answers "already loaded" for a name it has and keeps the
            # old weights, so fixed naming must drop the name first.
            await self._unload_to_replace(name)
        try:
            if in_place and isinstance(self.driver, InPlaceReplace):
                await self.driver.replace_adapter(name, path, budget_s=budget_s)
            else:
                await self.driver.load_adapter(name, path, budget_s=budget_s)
        except EngineError:
            await self._read_back_quietly()  # the load's own error is the one to report
            raise
        if in_place and isinstance(self.driver, CacheReset):
            # Same name, new weights: what the engine cached for the name was
            # computed with the old ones (the canary comes after this).
            await self.driver.reset_cache(budget_s=budget_s)
        self.adapters = await self.driver.list_adapters()
        listed = set(self.adapters)
        if name not in listed:
            raise NotListed(
                f"the engine of {self.worker_id} accepted adapter {name!r} but its "
                f"adapter list does not show it: {self.adapters}"
            )
        dropped = self.dropped_committed = [n for n in held if n not in listed]
        if dropped:
            raise EngineError(dropped_text(self.worker_id, name, dropped, self.adapters))

    async def _unload_to_replace(self, name: str) -> None:
        """Unload ``name`` to load it again. An engine whose unload waits for
        the requests running on the adapter (SGLang) would wait for ever on
        those its pause froze: generation continues for the unload (they
        finish on the old weights; a new request for the name is refused
        until the load), and the engine is paused again before the load."""
        waits = getattr(self.driver, "unload_waits_for_running", False)
        if not (waits and self.paused):
            await self.driver.unload_adapter(name)
            return
        await self.driver.resume()
        try:
            await self.driver.unload_adapter(name)
        finally:
            await self.driver.pause()

    async def _unload(self, names: list[str]) -> None:
        loaded = set(await self.driver.list_adapters())
        try:
            for name in names:
                if name in loaded:
                    await self.driver.unload_adapter(name)
        except EngineError:
            await self._read_back_quietly()
            raise
        self.adapters = await self.driver.list_adapters()

    async def _retire(self, names: list[str]) -> None:
        try:
            for name in names:
                if name in self.adapters:
                    await self.driver.unload_adapter(name)
                    self.adapters = [a for a in self.adapters if a != name]
        except EngineError:
            await self._read_back_quietly()
            if any(name in self.adapters for name in names):
                raise  # gone some other way (an engine restart) is as good as unloaded

    async def _read_back_quietly(self) -> None:
        """Refresh what the engine holds after a failure, keeping that failure's error."""
        try:
            self.adapters = await self.driver.list_adapters()
        except EngineError as exc:
            log.debug("worker=%s read-back after a failure failed too: %s", self.worker_id, exc)
