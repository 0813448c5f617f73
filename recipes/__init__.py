"""Recipes: user-level Trainer subclasses and models, selected with ``recipe=<name>``.

They use ddptrain's public API only, the way code outside this repository would.
"""
