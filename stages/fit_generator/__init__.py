"""fit-generator: real/train -> runs/<classes>/generator/, the in-house class-conditional UNet.

    python -m pipeline fit-generator --preset digits
    accelerate launch --multi_gpu -m pipeline fit-generator --preset cifar10

Standard DDPM training (Ho et al. 2020) of a class-conditional UNet, with an EMA of the weights
(what is saved: the generate stage samples from it), on the one training loop of
stages/common/loop.py; a run resumed from a checkpoint (``resume=auto``, the default) ends with
the very same weights as an uninterrupted one.

Classifier-free guidance: with ``label_dropout`` p > 0 the class table has a null row ∅ and a
share p of the training labels is replaced by it, so one network learns ε(x_t, y) and ε(x_t, ∅).
While it fits (every ``fidelity_every`` steps and at the end) the EMA weights draw pure-class
images from a fixed noise for every w of ``guidance_grid``, judged by a real-only CNN
(``judge_run``) and a linear probe (stages/common/fidelity.py): the curve goes to fidelity.json and
fidelity.png, and the best w (by the CNN) becomes the generator's recorded guidance, which
generate uses by default (``guidance=auto``).

Folder: unet/ + scheduler/ (``save_unet``), config.json, sample_grid.png, fidelity.json and
fidelity.png, manifest.json last (kind ``generator``, no shards; its info records ``null_class``
and the chosen ``guidance``). Checkpoints under checkpoints/checkpoint_<i>/ while it trains; they
are removed just before the manifest is written (a kill in between costs a retraining, never a
wrong folder).

The modules: stage.py (`run`: the inputs, the training, the outputs), training.py (the DDPM
step, its schedules and checkpoints, as units of the shared loop), recheck.py (a finished fit's
fidelity check redone for another guidance grid).
"""

from stages.fit_generator.stage import run

__all__ = ["run"]
