import pytest

from rlportable.errors import RlpError
from rlportable.runtime import get_backend, resolve_device
from rlportable.runtime.base import assemble_source
from rlportable.runtime.cache import cache_key


def test_unknown_device_is_an_error():
    with pytest.raises(RlpError, match="unknown device"):
        resolve_device("tpu")


def test_cpu_takes_no_kernel_source():
    with pytest.raises(RlpError, match="kernel-source"):
        get_backend("cpu", kernel_source="hip")


def test_sources_are_self_contained():
    for vendor in ("cuda", "hip"):
        text = assemble_source(vendor, "gemm")
        assert "rlp_round_scaled" in text and '#include "' not in text


def test_cache_key_depends_on_source_options_and_arch():
    base = cache_key("src", ("-a",), "sm_90", "nvrtc-13.0")
    assert base != cache_key("src2", ("-a",), "sm_90", "nvrtc-13.0")
    assert base != cache_key("src", ("-b",), "sm_90", "nvrtc-13.0")
    assert base != cache_key("src", ("-a",), "sm_80", "nvrtc-13.0")
