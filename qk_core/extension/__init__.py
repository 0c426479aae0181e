"""Context extension without training (SPEC 13): retrieval beyond C, the comparison across variants."""
