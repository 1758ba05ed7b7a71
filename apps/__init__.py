"""Ferry's Django apps, one concern each (fleet, catalog, rollouts, operations, accounts, core)."""
