"""generate: real/ (+ generator/ or a pretrained model) -> runs/<classes>/series/ (docs/methods.md §1).

    python -m pipeline generate --preset digits
    python -m pipeline generate --preset cifar100 --set model=/models/sd-v1-5 mixing.limit=64
    accelerate launch --multi_gpu -m pipeline generate --preset cifar10

CSM series: one initial noise per series, rendered at every mixing ratio α_k of a class pair
(k-way: at every point of a simplex lattice over k classes). The parts, in the order the stage
uses them: `plan` (which series exist: ids, classes, seeds, shards; a pure function of the
config), `model` (inputs, the backend and its identity, sampling with a float32 retry), `series`
(the samples of a shard, preview.png, the manifest's info), `check` (the endpoint check);
`stage` runs them.

Shards hold whole series. Under N processes rank r writes shards i ≡ r (mod N); complete shards
are skipped (resume); rank 0 writes preview.png and, last, manifest.json after all ranks finished.
Non-finite or blank images are never written: their series are redone in float32, or the stage
fails naming them.
"""

from stages.generate.model import Generators, sample_series
from stages.generate.plan import GenerationError, make_plan
from stages.generate.stage import run

__all__ = ["GenerationError", "Generators", "make_plan", "run", "sample_series"]
