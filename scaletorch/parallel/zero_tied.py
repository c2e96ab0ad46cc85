"""ZeRO for a model with tied embeddings (chapter 10): one weight shared by two units.

With ``lm_head.weight is embed_tokens.weight`` the one weight is sharded once, in the first unit
that lists it (the embedding's); the head unit *borrows* it. Why this and not a unit of its own
or two copies: it keeps "one parameter, one shard, one reduce-scatter" with no new unit kind.
Autograd sums the weight's two uses (lookup, output projection) into one gradient before its
post-accumulate hook fires, so that hook reduce-scatters the sum once, after the embedding's
backward. Stage 3 gathers the owner also around the head (forward and backward) and frees it
with the head: the embedding matrix crosses the wire twice more per micro-batch, 3 Psi + 2 V h
in all.

Under a pipeline the embedding and the head are on different ranks: each holds a copy
(tied_embeddings.py, tagged ``shared_embedding``), and the last stage's copy is a unit of its
own (``zero_units``), cut into shards exactly as the first stage's embedding unit, so that the
embedding group can sum the two copies' gradient shards element for element.
"""

from typing import Dict, List, cast

from torch import nn

from scaletorch.parallel.flat_unit import FlatUnit, holders_of, put_tensor
from scaletorch.parallel.zero import ShardedDataParallel, Units, llama_units


class TiedShardedDataParallel(ShardedDataParallel):
    """``ShardedDataParallel`` whose units may share parameters: the first unit that lists a
    parameter owns it, a later one borrows it and gathers and frees the owner with itself."""
    shares_parameters = True

    def _build_units(self, units: Units) -> List[FlatUnit]:
        # owner[id] = first unit listing the parameter; borrows[j] = the units whose
        # parameters unit j uses
        owner: Dict[int, int] = {}
        self.borrows: List[List[int]] = [[] for _ in units]
        for j, (_, modules) in enumerate(units):
            for _, sub in modules:
                for param in sub.parameters():
                    i = owner.setdefault(id(param), j)
                    if i != j and i not in self.borrows[j]:
                        self.borrows[j].append(i)
        # a pipeline's tied-embedding copy: the pipeline sums its shard's gradient with the
        # other copy's over the embedding group (read before the units replace the parameters)
        copies = [
            all(
                getattr(p, "shared_embedding", False) for _, sub in modules
                for p in sub.parameters()) for _, modules in units
        ]
        built = []  # in order: an owner first takes its parameters out of its borrowers
        for i, (name, modules) in enumerate(units):
            borrowers = [
                m for j, (_, mods) in enumerate(units) if i in self.borrows[j] for m in mods
            ]
            held = holders_of(borrowers)  # read before the unit replaces its own parameters
            unit = self.new_unit(name, modules, self.group, self.zero_stage)
            # the borrowers' holders of the unit's parameters hold the unit's tensors instead
            for key, (_, holders) in held.items():
                if key in unit.index:
                    k = unit.index[key]
                    for sub, attr, fqn in holders:
                        put_tensor(sub, attr, unit.tensors[k])
                        unit.names[k].append(fqn)
                        unit.slots[k].append((sub, attr, fqn))
            if copies[i]:
                unit.shard.shared_embedding = True  # type: ignore[attr-defined]
            built.append(unit)
        return built

    # a unit gathers and frees the units it borrows from with itself (not when prefetched)
    def _gather(self, i: int, async_op: bool = False) -> None:
        super()._gather(i, async_op)
        for k in [] if async_op else self.borrows[i]:
            super()._gather(k)

    def _free(self, i: int) -> None:
        super()._free(i)
        for k in self.borrows[i]:
            super()._free(k)


def zero_units(model: nn.Module) -> Units:
    """``llama_units``, with a pipeline's last-stage copy of a tied embedding in a unit of its
    own (the head is then the norm alone)."""
    units = llama_units(model)
    lm_head = cast(nn.Module, model.lm_head) if model.lm_head is not None else None
    if lm_head is not None and getattr(lm_head.weight, "shared_embedding", False):
        norm = cast(nn.Module, model.norm)
        units[-1:] = [("head", [("norm", norm)]), ("lm_head", [("lm_head", lm_head)])]
    return units
