import pytest

from rlportable.contract import spec
from rlportable.errors import ContractError


def test_every_contract_loads_and_names_pieces_that_exist():
    contracts = spec.load_all()
    assert {c.name for c in contracts} >= {"fixedpoint", "gemm", "rowsum"}
    for contract in contracts:
        spec.validate(contract)


def test_every_kernel_source_belongs_to_a_contract():
    from rlportable.build.offline_compile import families as vendor_families

    # a reference_only family (contracts/moe.toml) has no kernel source yet, and says what is missing
    families = {c.name for c in spec.load_all() if c.reference_only is None}

    for vendor in ("cuda", "hip"):
        sources = set(vendor_families())
        assert sources == families, (vendor, sources ^ families)


def test_missing_kernel_is_caught(tmp_path, monkeypatch):
    contract = spec.load_all()[0]
    contract.ops[0].kernels = contract.ops[0].kernels + ["no_such_kernel"]
    with pytest.raises(ContractError, match="no_such_kernel"):
        spec.validate(contract)


def test_malformed_contract_names_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[family]\nname = 'broken'\n")
    with pytest.raises(ContractError, match="broken.toml.*lacks"):
        spec.load(path)


def test_a_reference_only_family_names_no_sources_or_kernels(tmp_path):
    contracts = [c for c in spec.load_all() if c.reference_only is not None]
    assert contracts and all(c.cuda_source is None and not c.all_kernels() for c in contracts)
    op = ("[[op]]\nname = 'x'\nsummary = ''\nreference = 'route'\nkernels = {kernels}\ncomputes = ''\n"
          "inputs = []\noutputs = []\nparams = {{}}\ninvariances = []\nedge_cases = {{}}\n")
    family = "[family]\nname = 'moe'\nsummary = ''\nreference = 'rlportable.contract.moe'\nreference_only = 'no kernels'\n"
    path = tmp_path / "moe.toml"
    path.write_text(family + "hip_source = 'backends/portable/gemm.hip'\n" + op.format(kernels="[]"))
    with pytest.raises(ContractError, match="names no kernel sources"):
        spec.load(path)
    path.write_text(family + op.format(kernels="['moe_route']"))
    with pytest.raises(ContractError, match="names kernels"):
        spec.load(path)
    path.write_text(family + op.format(kernels="[]"))
    spec.validate(spec.load(path))


def test_entry_point_parser():
    source = 'extern "C" __global__ void __launch_bounds__(256) alpha(int x) {}\nextern "C" __global__ void beta (float* y) {}'
    assert spec.kernel_entry_points(source) == ["alpha", "beta"]


def test_fused_tile_table_matches_the_contract():
    from rlportable.ops.gemm_fused import FUSED_TILES

    gemm = next(c for c in spec.load_all() if c.name == "gemm")
    assert sorted(t.kernel for t in FUSED_TILES.values()) == sorted(gemm.cuda_only_kernels)
