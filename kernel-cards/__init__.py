"""Card sources.

Installed as `npu_hub_kernels.card_configs`, which carries each card's card.toml as package data: the single source of
truth for the cards (see mapping/npu_hub_kernels/cards.py)."""
