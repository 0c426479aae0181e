"""Asset modules, one per stage of the lineage graph: corpus -> capture -> analyses -> joins -> reports."""
