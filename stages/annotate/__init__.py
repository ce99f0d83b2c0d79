"""annotate: series/ + real/train -> runs/<classes>/mixed/, the shareable dataset (docs/methods.md §2).

    python -m pipeline annotate --preset digits
    accelerate launch --multi_gpu -m pipeline annotate --preset cifar100

Every mixed image gets λ̂ (its projection on the line through the prototypes of its two classes)
and the soft label t_a = σ(s(λ̂ − 0.5)); k-way series (`weights` in their json, generate's
mix_classes ≥ 3) get the barycentric λ̂ and t = softmax((s/2)·λ̂) over their k classes
(models/simplex.py). Each image is encoded exactly once: the real training images once for the
prototypes (skipped when mixed/prototypes.* already hold them for this encoder and this
real/train), every series image once for its λ̂.

The parts, in the order the stage uses them: `encoder` (the encoder and the prototypes),
`mixed` (series shard i -> mixed shard i, same keys and PNG bytes), `report` (annotation.json,
plots, generator fidelity). `stage` checks the inputs and runs them: under N processes rank r
writes shards i ≡ r (mod N); rank 0 computes the prototypes before the others start and writes
the report and the manifest after all finished.
"""

from stages.annotate.stage import run

__all__ = ["run"]
