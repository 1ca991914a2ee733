"""Imported by ``adadiag-ref ode --import _ode_plugin_family`` in tests/test_ode_cli.py: registers heavy ball as
family ``pluginball`` on import, as a user's plugin module does."""

from _heavy_ball_variants import heavy_ball_variant

from adadiag_ref.optim.families import register_family

register_family(*heavy_ball_variant("pluginball"))
