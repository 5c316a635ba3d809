"""Vertical logistic regression with Paillier and masked gradients (seed 001, seed 003)."""
