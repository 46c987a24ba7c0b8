"""Patches applied to mlx-lm's command modules right after they load."""


def patch(module):
    pass
