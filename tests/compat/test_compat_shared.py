"""The settings every process of a compat deployment shares (``settings.Shared``): how
they travel as text, and which of a worker's own conf values contradict them."""

from __future__ import annotations

import importlib.resources

import pytest

import tq_stream.compat
from tq_stream.compat.settings import ANNOTATION, Shared, to_plain
from tq_stream.deploy.ray_deploy import check_annotations
from tq_stream.errors import ConfigError

DRIVER = Shared(polling=True, capacity=4, units=3, timeout=5.0, mode="ray")


def full_default_config() -> dict:
    omegaconf = pytest.importorskip("omegaconf")
    tq_stream.compat.install()
    try:
        path = importlib.resources.files("transfer_queue") / "config.yaml"
        return to_plain(omegaconf.OmegaConf.load(path))
    finally:
        tq_stream.compat.uninstall()


def test_the_settings_travel_as_an_annotation_and_come_back_equal():
    assert Shared.annotated(DRIVER.annotation()) == DRIVER
    assert Shared.annotated({}) is None  # a deployment tq_stream.init started itself
    with pytest.raises(ConfigError, match=f"annotation '{ANNOTATION}' must hold the JSON"):
        Shared.annotated({ANNOTATION: "{not json"})


def test_the_full_default_config_unmerged_contradicts_nothing():
    conf = full_default_config()
    assert conf["controller"]["polling_mode"] is False  # the driver's is True
    DRIVER.check(conf)


@pytest.mark.parametrize(("conf", "message"), [
    ({"backend": {"SimpleStorage": {"total_storage_size": 8}}},
     "backend.SimpleStorage.total_storage_size must be 4 .* got 8"),
    ({"tq_stream": {"timeout": 9.0}}, "tq_stream.timeout must be 5.0 .* got 9.0"),
    ({"tq_stream": {"mode": "local"}}, "tq_stream.mode must be 'ray' .* got 'local'"),
])
def test_a_value_other_than_the_driver_s_and_the_default_is_refused(conf, message):
    with pytest.raises(ConfigError, match=message):
        DRIVER.check(conf)


def test_values_equal_to_the_driver_s_are_accepted():
    DRIVER.check({"controller": {"polling_mode": True},
                  "backend": {"SimpleStorage": {"total_storage_size": 4,
                                                "num_data_storage_units": 3}}})


@pytest.mark.parametrize("bad", [{"k": 1}, {1: "v"}, ["k"]])
def test_annotations_must_be_text(bad):
    with pytest.raises(ConfigError, match="annotations must map str to str"):
        check_annotations(bad)
