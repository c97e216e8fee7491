"""atb-plugin device side and service: platform, ops, models, multimodal, engine, server.

Empty until the device-side issue lands; see ../shared/DESIGN.md §5.
"""
