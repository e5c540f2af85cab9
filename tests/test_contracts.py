import pytest

from rlportable.contract import spec
from rlportable.errors import ContractError


def test_every_contract_loads_and_names_pieces_that_exist():
    contracts = spec.load_all()
    assert {c.name for c in contracts} >= {"fixedpoint", "gemm", "rowsum"}
    for contract in contracts:
        spec.validate(contract)


def test_every_kernel_source_belongs_to_a_contract():
    from rlportable.build.offline_compile import families as compiled_families
    from rlportable.resources import VENDOR_SUFFIX, resource_dir

    # a reference_only family (contracts/moe.toml) has no kernel source yet, and says what is missing
    families = {c.name for c in spec.load_all() if c.reference_only is None}
    assert set(spec.kernel_families()) == families == set(compiled_families())
    backends = resource_dir("backends")
    portable = {path.stem for path in (backends / "portable").glob("*.hip")}
    assert portable == families, portable ^ families
    for vendor, suffix in VENDOR_SUFFIX.items():
        fast_paths = {path.stem for path in (backends / vendor).glob(f"*{suffix}")}
        assert fast_paths <= families, (vendor, fast_paths - families)


def test_the_families_list_is_every_contract_once_in_its_order():
    families = spec.families()
    assert sorted(c.name for c in families) == sorted(c.name for c in spec.load_all())
    assert [c.order for c in families] == sorted({c.order for c in families})
    assert families[0].name == "fixedpoint"  # the encoding every other family's checks build on


def test_a_contract_does_not_name_its_sources(tmp_path):
    # each vendor's source follows resources.kernel_source_path; a path in the file could only disagree
    gemm = next(c for c in spec.load_all() if c.name == "gemm")
    assert gemm.source("cuda").as_posix().endswith("backends/cuda/gemm.cu")
    assert gemm.source("hip").as_posix().endswith("backends/hip/gemm.hip")
    rope = next(c for c in spec.load_all() if c.name == "rope")
    assert rope.source("cuda") == rope.source("hip") and rope.source("hip").as_posix().endswith("portable/rope.hip")
    path = tmp_path / "rope.toml"
    path.write_text(rope.path.read_text().replace("order = ", "cuda_source = 'backends/portable/rope.hip'\norder = "))
    with pytest.raises(ContractError, match="names cuda_source"):
        spec.load(path)


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
    contracts = [c for c in spec.load_all() if c.reference_only is not None]  # none today; the rule below
    assert all(c.source("cuda") is None and c.source("hip") is None and not c.all_kernels() for c in contracts)
    op = ("[[op]]\nname = 'x'\nsummary = ''\nreference = 'route'\nkernels = {kernels}\ncomputes = ''\n"
          "inputs = []\noutputs = []\nparams = {{}}\ninvariances = []\nedge_cases = {{}}\n")
    family = ("[family]\nname = 'nokernels'\nsummary = ''\nreference = 'rlportable.contract.moe'\norder = 99\n"
              "reference_only = 'no kernels'\n")
    path = tmp_path / "nokernels.toml"
    path.write_text(family + "hip_source = 'backends/portable/gemm.hip'\n" + op.format(kernels="[]"))
    with pytest.raises(ContractError, match="names hip_source"):
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
