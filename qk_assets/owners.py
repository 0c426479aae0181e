"""Who owns which assets: one team per asset group, shown as the asset's owners in the UI (issue 21.4).

A new asset group must be given a team here; :func:`with_owners` refuses an asset of an unknown group,
naming it. An owner declared on the asset itself is kept.
"""

from collections.abc import Iterable

from dagster import AssetsDefinition, AssetSpec

CAPTURE_TEAM = "team:qk-capture"  # registry, corpora, the Q/K capture (GPU)
ANALYSIS_TEAM = "team:qk-analysis"  # the SPEC 2-4, 6, 10, 11, 13 analyses
REPORTING_TEAM = "team:qk-reporting"  # benchmarks, joins, statistics, the report

OWNERS_BY_GROUP: dict[str, list[str]] = {
    "registry": [CAPTURE_TEAM], "corpus": [CAPTURE_TEAM], "capture": [CAPTURE_TEAM],
    "geometry": [ANALYSIS_TEAM], "plasticity": [ANALYSIS_TEAM], "cross_corpus": [ANALYSIS_TEAM],
    "interventions": [ANALYSIS_TEAM], "trajectory": [ANALYSIS_TEAM], "extension": [ANALYSIS_TEAM],
    "benchmarks": [REPORTING_TEAM], "report": [REPORTING_TEAM],
}


def _owned(spec: AssetSpec) -> AssetSpec:
    if spec.owners:
        return spec
    if spec.group_name not in OWNERS_BY_GROUP:
        raise ValueError(f"qk_assets/owners.py: asset '{spec.key.to_user_string()}' is in group "
                         f"'{spec.group_name}', which OWNERS_BY_GROUP does not list; add the group's team there")
    return spec.replace_attributes(owners=OWNERS_BY_GROUP[spec.group_name])


def with_owners(assets: Iterable[object]) -> list[object]:
    """Every asset definition with its group's owners (other objects unchanged)."""
    return [a.map_asset_specs(_owned) if isinstance(a, AssetsDefinition) else a for a in assets]
