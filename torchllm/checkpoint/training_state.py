"""The one training state: what a checkpoint saves and what a heal copies are one list.

A run's state is a list of named pieces, each registered once (`TrainingState.add`): the train
module's model, optimizer and LR schedule (TrainModule.pieces), the data loader's position, the
counters, the loss guard, the callbacks' states, semi-synchronous training's outer optimizer,
the RNG states. Two readers take the same list, each in its own form of a piece's kind:

    checkpoint (saved_states)   DCP tensors keyed by parameter names for a MODEL or an OPTIMIZER
                                (checkpoint/state.py: they reshard), one JSON text for an OBJECT
    heal (ft/heal.py)           a group's local tensors (the same rank of the other group has the
                                same layout), checked against the receiver's own; an OBJECT's
                                state_dict() as data

The rank-local parts, which a heal never sends:
- the RNG states (kind RNG): each process's own generators, saved per rank (`rng_rank<R>`);
- the part of an object that is its data-parallel rank's own: an object that has one says so by
  defining `peer_state_dict()` / `load_peer_state_dict()` (the data loader: its position without
  its rank, data/loader.py); a checkpoint saves its whole state per data-parallel rank
  (`<name>_dp<R>`), a heal sends what peer_state_dict() returns and the receiver keeps its part.
A piece may give the heal its own form (`peer`: an object with state_dict()/load_state_dict(),
e.g. DiLoCo's outer step: the outer momentum and the parameters at the last sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchllm.checkpoint.state import JSONState, ModelState, OptimizerState, RNGState

MODEL, OPTIMIZER, OBJECT, RNG = "model", "optimizer", "object", "rng"


@dataclass(frozen=True)
class Piece:
    """One named part of the training state.

    `name`: its key in a heal and, with its rank's suffix for a rank-local one, in a checkpoint;
    `obj`: the model, the optimizer, or an object with state_dict()/load_state_dict(); `kind`:
    MODEL, OPTIMIZER, OBJECT or RNG; `model`: an OPTIMIZER's model (its state keyed by the
    parameters' names); `peer`: what a heal sends and applies instead of the kind's form;
    `per_rank`: "" (one value for the run), "dp" (per data-parallel rank), "rank" (per process).
    """

    name: str
    obj: Any
    kind: str = OBJECT
    model: Any = None
    peer: Any = None
    per_rank: str = ""

    @property
    def sent(self) -> bool:
        """Whether a heal sends it (a process's own RNG states: never)."""
        return self.kind != RNG


class PeerPart:
    """The part of an object's state a peer may take (its peer_state_dict()), as a state."""

    def __init__(self, obj):
        self.obj = obj

    def state_dict(self) -> dict:
        return self.obj.peer_state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.obj.load_peer_state_dict(sd)

    def check(self) -> None:
        """ConfigError now (at launch) when no peer could ever take it."""
        self.obj.peer_state_dict()


class TrainingState:
    """The run's pieces in order (the order a checkpoint step and a heal hold them)."""

    def __init__(self, pieces=()):
        self.pieces: dict[str, Piece] = {}
        for piece in pieces:
            self.add_piece(piece)

    def add_piece(self, piece: Piece) -> None:
        if piece.name in self.pieces:
            raise ValueError(f"the training state has a piece {piece.name!r} already")
        self.pieces[piece.name] = piece

    def add(self, name: str, obj) -> None:
        """An object with state_dict()/load_state_dict(): saved as JSON, sent as data; one with
        peer_state_dict() is partly its data-parallel rank's own (module doc)."""
        if hasattr(obj, "peer_state_dict"):
            self.add_piece(Piece(name, obj, OBJECT, peer=PeerPart(obj), per_rank="dp"))
        else:
            self.add_piece(Piece(name, obj))

    def add_rng(self) -> None:
        self.add_piece(Piece("rng", RNGState(), RNG, per_rank="rank"))

    @classmethod
    def of(cls, model, optimizer=None, lr_scheduler=None, dataloader=None, train_state=None,
           others: dict | None = None) -> "TrainingState":
        """The state of a run's parts given one by one (a bare model, a benchmark's), with the
        process's RNG states."""
        state = cls([Piece("model", model, MODEL)])
        if optimizer is not None:
            state.add_piece(Piece("optimizer", optimizer, OPTIMIZER, model=model))
        if lr_scheduler is not None:
            state.add("lr_scheduler", lr_scheduler)
        if dataloader is not None:  # a position per data-parallel rank
            peer = PeerPart(dataloader) if hasattr(dataloader, "peer_state_dict") else None
            state.add_piece(Piece("dataloader", dataloader, peer=peer, per_rank="dp"))
        for name, obj in (("train_state", train_state), *(others or {}).items()):
            if obj is not None:
                state.add(name, obj)
        state.add_rng()
        return state

    def names(self) -> list[str]:
        return list(self.pieces)

    def get(self, name: str):
        """The object of piece `name`, or None."""
        piece = self.pieces.get(name)
        return piece.obj if piece is not None else None

    def key(self, piece: Piece, dp_rank: int, rank: int) -> str:
        """`piece`'s key in a checkpoint step (a rank-local one: its rank's)."""
        return {"": piece.name, "dp": f"{piece.name}_dp{dp_rank}",
                "rank": f"{piece.name}_rank{rank}"}[piece.per_rank]

    def saved_states(self, dp_rank: int = 0, rank: int = 0) -> dict[str, Any]:
        """Checkpoint key -> what DCP saves and loads (checkpoint/state.py's adapters)."""
        return {self.key(p, dp_rank, rank): _saved(p) for p in self.pieces.values()}

    def sent(self) -> dict[str, Piece]:
        """The pieces a heal sends, by name (all but the rank-local RNG states)."""
        return {name: p for name, p in self.pieces.items() if p.sent}


def _saved(piece: Piece):
    if piece.kind == MODEL:
        return ModelState(piece.obj)
    if piece.kind == OPTIMIZER:
        return OptimizerState(piece.model, piece.obj)
    if piece.kind == RNG:
        return piece.obj
    return JSONState(piece.obj)
