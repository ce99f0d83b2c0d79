"""publish / pull against the real huggingface_hub client, offline.

The client's network methods are monkeypatched on the `HfApi` class to record calls (or copy a
local folder for snapshot_download); everything else, the operations handed to create_commit
included, is the shipped code path.
"""

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import numpy as np
import pytest
import yaml
from conftest import snapshot
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, DatasetCard, HfApi
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
from huggingface_hub.hf_api import DatasetInfo
from PIL import Image
from safetensors.numpy import save_file

from core.io import atomic_write_json
from core.version import code_version
from pipeline.cli import main
from shards import card
from shards.manifest import MANIFEST, Manifest, ShardRecord
from shards.reader import load_split
from shards.writer import ShardFolder, write_config
from stages.presets import data_license
from stages.publish import CARD_BANNER

REPO = "someone/semix-digits"
SENTINEL = "hf_SENTINELtoken0123456789abcdef"
NETWORK = ("create_repo", "dataset_info", "hf_hub_download", "create_commit", "snapshot_download")
K, SIZE, CLASSES = 4, 8, ("zero", "one", "two")
SHARDS = ["mixed-000000.tar", "mixed-000001.tar"]
EXTRAS = ["annotation.json", "annotation.png", "preview.png", "prototypes.safetensors"]
GENERATOR = dict(
    backend="unet",
    model_id="runs/digits/generator",
    revision="",
    sampler="ddim",
    steps=10,
    guidance=0.0,
    license="",
)


def make_mixed(
    folder: Path, *, model_id: str = "runs/digits/generator", encoder: str = "quick-cnn"
) -> Path:
    """A small mixed/ folder in the on-disk format of docs/architecture.md (3 series, K=4)."""
    alphas = [k / (K - 1) for k in range(K)]
    pairs = [(0, 1), (0, 2), (1, 2)]
    gen = dict(GENERATOR, model_id=model_id)
    write_config(folder, {"stage": "annotate", "out": str(folder.parent.parent)})
    writer = ShardFolder(folder, prefix="mixed")
    rng = np.random.default_rng(0)
    samples = []
    for sid, (a, b) in enumerate(pairs):
        for k, alpha in enumerate(alphas):
            lam = alpha + 0.05 * (k - 1.5)
            t_a = float(1 / (1 + np.exp(-4.0 * (lam - 0.5))))
            meta = dict(series=sid, position=k, classes=[a, b], names=[CLASSES[a], CLASSES[b]])
            meta.update(alpha=alpha, seed=1000 + sid, generator=f"unet/{model_id}")
            meta.update(revision="", sampler="ddim", steps=10, guidance=0.0)
            meta.update(lambda_hat=lam, soft=[t_a, 1 - t_a])
            image = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
            cls = a if t_a >= 0.5 else b
            samples.append(
                {"__key__": f"s{sid:07d}_{k:02d}", "png": image, "cls": cls, "json": meta}
            )
    writer.write(0, samples[: 2 * K])  # shards hold whole series
    writer.write(1, samples[2 * K :])
    annotation = dict(method="projection", encoder={"name": "quick-cnn"}, prototypes="real")
    prototypes = {"prototypes": np.zeros((3, 5), dtype=np.float32)}
    save_file(prototypes, folder / "prototypes.safetensors", metadata={"encoder": encoder})
    info = dict(generator=gen, alphas=alphas, series_per_pair=1, num_series=3, num_pairs=3)
    info.update(image_size=SIZE, annotation=dict(annotation, sharpening=4.0))
    upstream = {"series": "a" * 64, "real": "b" * 64}
    writer.finish(
        2,
        kind="mixed",
        class_names=CLASSES,
        upstream=upstream,
        code_version="0.1.0+gtest",
        info=info,
    )
    per_alpha = [dict(alpha=a, n=3, mean=a, std=0.01) for a in alphas]
    stats = dict(n_images=12, n_series=3, spearman_lambda_alpha=0.987, monotone_share=1.0)
    stats.update(n_series_checked=3, per_alpha=per_alpha)
    stats["lambda_hat"] = dict(mean=0.5, std=0.4, min=-0.075, max=1.075)
    stats["lambda_hat"].update(share_below_0=1 / 12, share_above_1=1 / 12)
    atomic_write_json(folder / "annotation.json", stats)
    for name in ("annotation.png", "preview.png"):
        Image.new("RGB", (4, 4), (9, 9, 9)).save(folder / name)
    return folder


@pytest.fixture
def mixed(tmp_path):
    return make_mixed(tmp_path / "runs" / "digits" / "mixed")


@pytest.fixture(autouse=True)
def offline_hub(monkeypatch, tmp_path):
    """Any Hub call a test did not stub fails the test loudly (AssertionError is not caught)."""
    for name in NETWORK:

        def refuse(self, *args, _name=name, **kwargs):
            raise AssertionError(f"unexpected network call HfApi.{_name}")

        monkeypatch.setattr(HfApi, name, refuse)
    monkeypatch.setenv("HF_TOKEN", SENTINEL)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))


def publish_cli(tmp_path, *sets):
    sets = ("--set", f"out={tmp_path / 'runs'}", f"repo={REPO}", *sets)
    return main(["publish", "--preset", "digits", *sets])


def fake_hub(monkeypatch, remote_files=(".gitattributes",), remote_manifest=None, private=True):
    """Stub the client's network methods; returns the list of recorded (method, args, kwargs)."""
    calls = []

    def record(name, result=None):
        def method(self, *args, **kwargs):
            calls.append((name, args, kwargs))
            return result(*args, **kwargs) if callable(result) else result

        monkeypatch.setattr(HfApi, name, method)

    siblings = [{"rfilename": f} for f in remote_files]
    record("create_repo")
    record("dataset_info", DatasetInfo(id=REPO, private=private, siblings=siblings))
    record("hf_hub_download", lambda *a, **k: str(remote_manifest))
    record("create_commit", SimpleNamespace(commit_url=f"https://hub/{REPO}/commit/1"))
    return calls


def one_line_error(capsys, code):
    out = capsys.readouterr()
    assert code == 1 and out.err.count("\n") == 1 and out.err.startswith("semix "), out
    return out.err + out.out


# ----------------------------------------------------------------------------- card


def dry_run_card(tmp_path, capsys) -> tuple[str, str]:
    """(plan text, card text) as a dry run prints them."""
    assert publish_cli(tmp_path, "dry_run=1") == 0  # the autouse fixture forbids network calls
    out = capsys.readouterr().out
    plan, banner, rest = out.partition(CARD_BANNER + "\n")
    card_text, done, _ = rest.rpartition("semix publish: done -> ")
    assert banner and done, out
    return plan, card_text


def test_dry_run_prints_plan_and_card_and_writes_nothing(mixed, tmp_path, capsys):
    before = snapshot(tmp_path)
    plan, text = dry_run_card(tmp_path, capsys)
    assert snapshot(tmp_path) == before  # mixed/ (and everything else) byte- and mtime-identical
    assert not (mixed / "README.md").exists()
    meta = yaml.safe_load(text.split("---\n")[1])
    assert meta == DatasetCard(text).data.to_dict()
    assert meta["license"] == "cc-by-4.0"  # unet trained on the digits -> the digits' license
    assert meta["task_categories"] == ["image-classification"]
    assert meta["size_categories"] == ["n<1K"]
    assert {"semix", "calibration", "synthetic"} <= set(meta["tags"])
    assert meta["configs"] == [
        {"config_name": "default", "data_files": [{"split": "train", "path": "mixed-*.tar"}]}
    ]
    for fact in ("runs/digits/generator", "ddim, 10 steps", "0, 0.3333, 0.6667, 1", "| 4 |"):
        assert fact in text
    for fact in ("projection", "| encoder | `quick-cnn` |", "| 12 / 2 |", "0.987", "100.0% (of 3)"):
        assert fact in text
    assert "![preview](preview.png)" in text and "![annotation](annotation.png)" in text
    assert "Beyond One-Hot Labels" in text and "ICML" in text and "0.1.0+gtest" in text
    assert f'load_dataset("{REPO}"' in text and "wds.WebDataset" in text
    assert str(tmp_path) not in text and SENTINEL not in text
    rows = [line.split() for line in plan.splitlines()[1:] if line.startswith("  ")]
    assert [r[0] for r in rows] == [*SHARDS, MANIFEST, "README.md", *EXTRAS]
    assert f"{(mixed / 'mixed-000000.tar').stat().st_size:,} B" in plan
    assert rows[len(SHARDS) + 1][1] == f"{len(text.encode()):,}"  # the card's own size
    # an old card left in mixed/ by an earlier semix is neither read nor uploaded
    old = snapshot(mixed)
    (mixed / "README.md").write_text("stale card")
    assert dry_run_card(tmp_path, capsys)[1] == text
    (mixed / "README.md").unlink()
    assert snapshot(mixed) == old


def test_card_rows_name_the_encoder_plainly():
    """A classifier encoder's identity (models.encoders, annotate's `encoder=classifier`) holds
    a nested arch config: the card gives it rows of its own, never `arch=arch=...`."""
    identity = {
        "kind": "module",
        "run": "encoder",
        "arch": {"arch": "digits-cnn", "num_classes": 10, "in_channels": 1},
        "weights_sha256": "ab" * 32,
        "image_size": [16, 16],
        "mean": [0.5],
        "std": [0.25],
        "interpolation": "bilinear",
        "resize_mode": "squash",
    }
    annotation = {"method": "projection", "encoder": identity, "sharpening": 4.0}
    manifest = Manifest(
        kind="mixed",
        class_names=CLASSES,
        shards=(ShardRecord("mixed-000000.tar", 12, "c" * 64, 100),),
        info={"generator": GENERATOR, "annotation": annotation, "image_size": SIZE},
    )
    text = str(card.build_card(manifest, None, repo=REPO, license_id="mit", license_note="",
                               files=[]))  # fmt: skip
    assert "arch=arch" not in text
    assert "| encoder | semix classifier (train run `encoder`) |" in text
    assert "| encoder architecture | digits-cnn (num_classes=10, in_channels=1) |" in text
    assert f"| encoder weights | sha256 `{'ab' * 32}` |" in text
    assert "| encoder input | 16x16 px, bilinear resize (squash), mean 0.5, std 0.25 |" in text
    assert "encoder (other)" not in text  # every field of the identity has its row
    # nested mappings anywhere else read as key=(...)
    assert card._fmt({"arch": {"arch": "cnn", "width": 8}}) == "arch=(arch=cnn, width=8)"


LICENSE_CASES = [  # backend, model id, dataset, recorded license, override -> expected
    ("sd", "sd-legacy/stable-diffusion-v1-5", "cifar10", "", "", "creativeml-openrail-m"),
    ("sd", "stabilityai/stable-diffusion-2-1-base", "cifar10", "", "", "openrail++"),
    ("dit", "facebook/DiT-XL-2-256", "tiny-imagenet", "", "", "cc-by-nc-4.0"),
    ("unet", "runs/digits/generator", "digits", "", "", "cc-by-4.0"),
    ("unet", "runs/cifar100/generator", "cifar100", "", "", "other"),
    ("sd", "someone/fancy-model", "cifar10", "", "", "other"),
    ("sd", "someone/fancy-model", "cifar10", "apache-2.0", "", "apache-2.0"),
    ("sd", "sd-legacy/stable-diffusion-v1-5", "cifar10", "", "mit", "mit"),
]


@pytest.mark.parametrize(
    ("backend", "model", "dataset", "recorded", "override", "want"), LICENSE_CASES
)
def test_license_logic(backend, model, dataset, recorded, override, want):
    generator = {"backend": backend, "model_id": model, "license": recorded}
    lic, note = card.license_for(generator, data_license(dataset), override)
    assert lic == want and f"`{want}`" in note
    assert ("does not know the license" in note) == (want == "other")


def test_bad_license_override_and_repo_are_config_errors(tmp_path, mixed, capsys):
    assert publish_cli(tmp_path, "license=wtfpl") == 2
    assert "choose one of" in capsys.readouterr().err
    for stage in ("publish", "pull"):
        assert main([stage, "--set", "repo=a/b/c"]) == 2
        assert "is not a Hub repo id" in capsys.readouterr().err


def committed_files(ops) -> dict[str, bytes]:
    """What a create_commit would put in the repo: path -> bytes (files or in-memory bytes)."""
    out = {}
    for op in ops:
        with op.as_file() as f:
            out[op.path_in_repo] = f.read()
    return out


def test_published_card_comes_back_with_pull_and_loads_in_datasets(
    mixed, tmp_path, monkeypatch, capsys
):
    """publish -> (the repo's files) -> pull: the card arrives next to the shards, and
    `datasets` reads the folder through the card's `configs` glob with one feature set."""
    datasets = pytest.importorskip("datasets")
    _, card_text = dry_run_card(tmp_path, capsys)
    calls = fake_hub(monkeypatch)
    assert publish_cli(tmp_path) == 0
    remote = tmp_path / "remote"
    remote.mkdir()
    for name, data in committed_files(calls[-1][1][1]).items():
        (remote / name).write_bytes(data)
    fake_snapshot(monkeypatch, remote)
    assert pull_cli(tmp_path) == 0
    dest = tmp_path / "pulled" / "semix-digits" / "mixed"
    assert (dest / "README.md").read_text() == card_text
    card = DatasetCard.load(dest / "README.md")
    glob = card.data.to_dict()["configs"][0]["data_files"][0]["path"]
    cache = str(tmp_path / "hf-cache")
    by_glob = datasets.load_dataset(
        "webdataset", data_files={"train": str(dest / glob)}, split="train", cache_dir=cache
    )
    by_card = datasets.load_dataset(str(dest), split="train", cache_dir=cache)  # reads the card
    split = load_split(mixed)
    for ds in (by_glob, by_card):
        assert len(ds) == len(split) == 12
        assert {"png", "cls", "json"} <= set(ds.features)
        json_feature = ds.features["json"]
        assert {"alpha", "lambda_hat", "soft", "series", "classes", "names"} <= set(json_feature)
        keys = {tuple(sorted(row["json"])) for row in ds}
        assert len(keys) == 1
        row = ds[5]
        assert np.array_equal(np.asarray(row["png"].convert("RGB")), split.images[5].numpy())
        assert row["json"]["soft"] == pytest.approx(split.meta[5]["soft"])


# ----------------------------------------------------------------------------- publish


def test_publish_hands_the_exact_plan_to_create_commit(mixed, tmp_path, monkeypatch, capsys):
    _, card_text = dry_run_card(tmp_path, capsys)
    before = snapshot(mixed)
    calls = fake_hub(monkeypatch)
    assert publish_cli(tmp_path, "private=1") == 0
    assert snapshot(mixed) == before  # the upload wrote nothing into mixed/
    names = [c[0] for c in calls]
    assert names == ["create_repo", "dataset_info", "create_commit"]
    (_, args, kwargs) = calls[0]
    assert args == (REPO,) and kwargs == {"repo_type": "dataset", "private": True, "exist_ok": True}
    (_, args, kwargs) = calls[2]
    assert args[0] == REPO and kwargs["repo_type"] == "dataset"
    assert (
        code_version() in kwargs["commit_message"]
        and "12 mixed samples" in kwargs["commit_message"]
    )
    ops = args[1]
    assert all(isinstance(op, CommitOperationAdd) for op in ops)
    assert [op.path_in_repo for op in ops] == [*SHARDS, MANIFEST, "README.md", *EXTRAS]
    uploaded = committed_files(ops)
    assert uploaded.pop("README.md") == card_text.encode()  # the card the dry run showed
    assert uploaded == {name: (mixed / name).read_bytes() for name in uploaded}
    assert all("token" not in kw for _, _, kw in calls)  # the client finds the token itself


def test_repo_with_a_different_manifest_is_refused_unless_overwrite(
    mixed, tmp_path, monkeypatch, capsys
):
    theirs = tmp_path / "their-manifest.json"
    theirs.write_text('{"kind": "mixed", "shards": []}\n')
    remote = (".gitattributes", MANIFEST, "mixed-000000.tar", "mixed-000007.tar")
    calls = fake_hub(monkeypatch, remote_files=remote, remote_manifest=theirs)
    err = one_line_error(capsys, publish_cli(tmp_path))
    assert "already holds a different dataset" in err and "overwrite=true" in err
    assert "create_commit" not in [c[0] for c in calls]
    assert publish_cli(tmp_path, "overwrite=1") == 0
    ops = calls[-1][1][1]
    deletes = [op.path_in_repo for op in ops if isinstance(op, CommitOperationDelete)]
    assert deletes == ["mixed-000007.tar"]  # a stale shard would match the card's glob
    # the same manifest (a rerun / resume) is not "different content"
    calls = fake_hub(monkeypatch, remote_files=remote, remote_manifest=mixed / MANIFEST)
    assert publish_cli(tmp_path) == 0
    assert not [op for op in calls[-1][1][1] if isinstance(op, CommitOperationDelete)]


def _client_http_module():
    return sys.modules[huggingface_hub.errors.Response.__module__.split(".")[0]]


def _network_errors():
    http = _client_http_module()
    request = http.Request("POST", f"https://huggingface.co/api/repos/create?t={SENTINEL}")
    response = http.Response(401, request=request)
    return [
        ConnectionError(f"Connection refused (token {SENTINEL})"),
        OfflineModeIsEnabled("HF_HUB_OFFLINE=1"),
        http.ConnectError(f"[Errno 111] refused Bearer {SENTINEL}", request=request),
        HfHubHTTPError(f"401 Unauthorized\nAuthorization: Bearer {SENTINEL}", response=response),
    ]


@pytest.mark.parametrize("error", range(4))
def test_network_failure_is_one_line_and_never_shows_the_token(
    error, mixed, tmp_path, monkeypatch, capsys, caplog
):
    exc = _network_errors()[error]
    fake_hub(monkeypatch)

    def fail(self, *args, **kwargs):
        raise exc

    monkeypatch.setattr(HfApi, "create_commit", fail)
    text = one_line_error(capsys, publish_cli(tmp_path))
    assert ("cannot reach" in text) or ("HTTP 401" in text and "HF_TOKEN" in text)
    everything = (
        text + caplog.text + "".join(p.read_text(errors="ignore") for p in mixed.glob("*.md"))
    )
    assert SENTINEL not in everything


def test_missing_token_is_one_line(mixed, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN")
    calls = fake_hub(monkeypatch)
    assert "no Hugging Face token" in one_line_error(capsys, publish_cli(tmp_path))
    assert calls == []


def test_incomplete_corrupt_or_local_path_folders_are_refused(tmp_path, monkeypatch, capsys):
    calls = fake_hub(monkeypatch)
    folder = make_mixed(tmp_path / "runs" / "digits" / "mixed")
    (folder / MANIFEST).rename(tmp_path / "manifest.bak")
    assert "no manifest.json" in one_line_error(capsys, publish_cli(tmp_path))
    (tmp_path / "manifest.bak").rename(folder / MANIFEST)
    shard = folder / "mixed-000001.tar"
    data = bytearray(shard.read_bytes())
    data[700] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert "sha256 mismatch" in one_line_error(capsys, publish_cli(tmp_path))
    shutil.rmtree(tmp_path / "runs")
    make_mixed(tmp_path / "runs" / "digits" / "mixed", model_id=str(tmp_path / "weights"))
    text = one_line_error(capsys, publish_cli(tmp_path))
    assert "local path: manifest.json.info.generator.model_id" in text
    shutil.rmtree(tmp_path / "runs")
    make_mixed(tmp_path / "runs" / "digits" / "mixed", encoder=str(tmp_path / "encoder.pt"))
    text = one_line_error(capsys, publish_cli(tmp_path))
    assert "local path: prototypes.safetensors.encoder" in text
    assert calls == []


def test_private_publish_to_an_existing_public_repo_is_refused(
    mixed, tmp_path, monkeypatch, capsys
):
    calls = fake_hub(monkeypatch, private=False)
    assert "is public" in one_line_error(capsys, publish_cli(tmp_path, "private=1"))
    assert [c[0] for c in calls] == ["create_repo", "dataset_info"]


# ----------------------------------------------------------------------------- pull


def fake_snapshot(monkeypatch, source: Path, corrupt: str = "", edit=None):
    """snapshot_download stand-in: copy `source` the way a download lays it out."""
    calls = []

    def snapshot_download(self, repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        local = Path(kwargs["local_dir"])
        local.mkdir(parents=True, exist_ok=True)
        for pattern in kwargs["allow_patterns"]:
            for f in source.glob(pattern):
                shutil.copy(f, local / f.name)
        (local / ".cache" / "huggingface" / "download").mkdir(parents=True, exist_ok=True)
        (local / ".cache" / "huggingface" / "download" / "x.metadata").write_text("etag\n")
        if corrupt:
            data = bytearray((local / corrupt).read_bytes())
            data[700] ^= 0xFF
            (local / corrupt).write_bytes(bytes(data))
        if edit:
            edit(local / MANIFEST)
        return str(local)

    monkeypatch.setattr(HfApi, "snapshot_download", snapshot_download)
    return calls


def pull_cli(tmp_path, *sets):
    sets = ("--set", f"out={tmp_path / 'pulled'}", f"repo={REPO}", *sets)
    return main(["pull", "--preset", "digits", *sets])


def test_pull_verifies_and_installs_a_usable_folder(mixed, tmp_path, monkeypatch, capsys):
    calls = fake_snapshot(monkeypatch, mixed)
    assert pull_cli(tmp_path, "revision=v1") == 0
    assert calls[0][0] == REPO and calls[0][1]["repo_type"] == "dataset"
    assert calls[0][1]["revision"] == "v1"
    dest = tmp_path / "pulled" / "semix-digits" / "mixed"
    got, want = load_split(dest, verify=True), load_split(mixed)
    assert same_split(got, want)
    want_files = [*SHARDS, MANIFEST, *EXTRAS]  # no .cache, .done, config.json
    assert sorted(p.name for p in dest.iterdir()) == sorted(want_files)
    assert [p.name for p in dest.parent.iterdir()] == ["mixed"]  # no temporary folder left
    capsys.readouterr()
    assert "already exists" in one_line_error(capsys, pull_cli(tmp_path))
    assert pull_cli(tmp_path, "name=again") == 0
    assert pull_cli(tmp_path, "overwrite=1") == 0


def same_split(a, b):
    return a.keys == b.keys and bool((a.images == b.images).all()) and a.meta == b.meta


def _lie_about_count(path):
    manifest = json.loads(path.read_text())
    manifest["shards"][1]["count"] += 1
    manifest["num_samples"] += 1  # self-consistent: only counting the samples can catch it
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("corrupt", "edit", "message"),
    [
        ("mixed-000001.tar", None, "mixed-000001.tar: sha256 mismatch"),
        ("", _lie_about_count, "mixed-000001.tar: 4 samples, manifest.json says 5"),
        ("", Path.unlink, "no manifest.json: not a semix dataset"),
    ],
)
def test_pull_refuses_a_bad_download_and_leaves_nothing_complete(
    corrupt, edit, message, mixed, tmp_path, monkeypatch, capsys
):
    fake_snapshot(monkeypatch, mixed, corrupt=corrupt, edit=edit)
    text = one_line_error(capsys, pull_cli(tmp_path))
    assert message in text and "nothing was installed" in text
    assert not list((tmp_path / "pulled").rglob(MANIFEST))


def test_pull_network_failure_is_one_line(tmp_path, monkeypatch, capsys):
    def fail(self, *args, **kwargs):
        raise _network_errors()[2]

    monkeypatch.setattr(HfApi, "snapshot_download", fail)
    text = one_line_error(capsys, pull_cli(tmp_path))
    assert "download someone/semix-digits: cannot reach" in text and SENTINEL not in text
    assert not list((tmp_path / "pulled").rglob(MANIFEST))
