"""What a rank does with the coordinator's messages: tuned knobs, cache slots, responses, shutdown notices.

A part of the engine over its :class:`~horovod.engine.engine_state.EngineState`. On a worker it reads rank 0's
connection; on rank 0 the coordination step uses :meth:`Follower.receive` and :meth:`Follower.obey_shutdown` for
every worker's connection. With the warm path a message runs only once the round it was sent in is finished here
(the ordering rule of :mod:`horovod.engine.warm`), so messages may be kept in the warm path's queue first.
"""
from __future__ import annotations

from typing import Callable, List, Optional

from horovod.engine.engine_state import EngineState
from horovod.engine.errors import SHUTDOWN_MESSAGE, PeerFailureError, ShutdownError
from horovod.engine.messages import ControlMessage
from horovod.engine.responses import Responses
from horovod.engine.teardown import Teardown
from horovod.transport.base import TransportError
from horovod.transport.sockets import PeerError


class Follower:
    """Receiving and running the coordinator's messages (see the module docstring).

    Args:
        state: the engine's state.
        teardown: ends the engine when a peer is gone or says so.
        responses: carries out the responses of a message.
        advance_rounds: makes every step of the warm path's rounds possible now; False once the engine is finished
            (the drive loop's; used to finish the open round before an orderly leave).
    """

    def __init__(self, state: EngineState, teardown: Teardown, responses: Responses,
                 advance_rounds: Callable[[], bool]):
        self.state = state
        self.teardown = teardown
        self.responses = responses
        self.advance_rounds = advance_rounds

    def receive(self, peer: int) -> Optional[List[ControlMessage]]:
        """Messages from ``peer`` in order, up to and including a shutdown notice; ``None`` if the peer is gone.

        Whatever arrived before a shutdown notice must still be handled (the last responses of a rank that
        finished), so the caller processes the list and then :meth:`obey_shutdown`.
        """
        state = self.state
        try:
            messages = state.control.receive(peer)
        except PeerError as exc:
            relay = state.coordinator is not None
            who = f"rank {peer}" if relay else "the coordinator (rank 0)"
            self.teardown.die(PeerFailureError(f"{who} closed its control connection (the process exited or "
                                               f"crashed): {exc}. {SHUTDOWN_MESSAGE}", culprit=peer), notify=relay)
            return None
        for i, msg in enumerate(messages):
            if msg.shutdown:
                return messages[:i + 1]
        return messages

    def obey_shutdown(self, msg: ControlMessage) -> bool:
        """Go down when ``msg`` says so (the coordinator relays it to everyone); True if it did."""
        if not msg.shutdown:
            return False
        state = self.state
        if state.warm is not None and not msg.failure and not state.finishing:
            # An orderly leave: the leaver finished its rounds, so this rank can finish them too and run what the
            # coordinator sent before the notice (the last responses of a rank that finished).
            state.finishing = True
            try:
                state.warm.finish_open_round(self.advance_rounds)
            except (PeerError, TransportError, OSError):
                pass
        reason = msg.reason or SHUTDOWN_MESSAGE
        self.teardown.die(PeerFailureError(reason) if msg.failure else ShutdownError(reason),
                          notify=state.coordinator is not None)
        return True

    def follow(self, readable) -> bool:
        """A worker: run (or keep, with the warm path) what the coordinator sent; False once the engine is
        finished."""
        if 0 in readable:
            messages = self.receive(0)
            if messages is None:
                return False
            warm = self.state.warm
            for msg in messages:
                if self.obey_shutdown(msg):
                    return False
                if warm is not None:
                    if not warm.fence(msg):
                        warm.deferred.append(msg)   # runs once its round is finished here
                else:
                    self.run_message(msg)
        return True

    def run_message(self, msg: ControlMessage) -> None:
        """Carry out one message of the coordinator: tuned knobs, dropped and assigned cache slots, responses."""
        state = self.state
        if msg.params:
            state.config = state.config.replace(**msg.params)
        if state.warm is not None and (msg.invalidate or any(r.slots for r in msg.responses)):
            own = {}
            with state.lock:
                for resp in msg.responses:
                    if resp.slots:
                        for name in resp.names:
                            entry = state.inflight.get((resp.process_set, name))
                            if entry is not None:
                                own[name] = entry.request
            state.warm.apply(msg, own)
        self.responses.execute_all(msg.responses)

    def read_control(self) -> bool:
        """A worker: take in whatever the coordinator has sent (kept until its round is finished); False once the
        engine is finished. Nothing while it finishes its rounds after a shutdown notice: everything sent before
        the notice came with it."""
        state = self.state
        if state.coordinator is None and 0 in state.control.peers and not state.finishing:
            self.follow([0])
        return state.dead is None
