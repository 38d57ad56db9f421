"""bench/codec_entropy.py models the codec's bytes: on generated pairs its model of
the sparse coding must track what `dcr delta make` writes, and its floors and the
class split must be what they claim to be against that model."""

import sys
from pathlib import Path

import pytest

from conftest import dcr_json

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from codec_entropy import estimate  # noqa: E402


@pytest.mark.parametrize("update", ["training", "stress"])
def test_the_model_tracks_the_codec_and_the_floors_are_below_it(gen_cache, tmp, update):
    out, _ = gen_cache.get("qwen3-moe", update=update, rate=0.03, seed=5, size="16MB", versions=1)
    delta = dcr_json("delta", "make", out / "v0", out / "v1", "-o", tmp / "d", "--json")
    r = estimate(out / "v0", out / "v1", ks=(1, 4))
    assert r["changes"] == delta["changed_elements"]  # every tensor of the synthetic model is BF16
    codec = delta["payload_bytes"] / delta["changed_elements"]
    # The codec picks its parameters on a sample: a little above the best ones.
    assert r["codec model"] <= codec <= 1.02 * r["codec model"]
    # One class is the codec's coding again, plus its header.
    assert r["classes 1"] == pytest.approx(r["codec model"], rel=0.005)
    assert r["floor exponent"] <= r["floor iid"] <= r["codec model"]
    if update == "training":
        # Training changes depend on the old exponent; the class split finds it.
        assert r["classes 4"] < 0.9 * r["codec model"]
    else:
        # Stress changes do not: no class split gains, nor does the floor.
        assert r["classes 4"] == pytest.approx(r["codec model"], rel=0.01)
        assert r["floor exponent"] == pytest.approx(r["floor iid"], rel=0.01)
