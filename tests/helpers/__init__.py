"""What the tests share: models, the parity harness, rank launchers and checks. Tests live one level up."""
