"""Model routers: ``get_router(model_dir)`` and one router per family. Arrives with the
routers / input-builders issue; see ../shared/DESIGN.md §4."""
