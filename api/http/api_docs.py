"""The API's documentation page (Swagger UI at /schema/swagger), served entirely by this server.

Operators run offline: the page's script, style sheet and icon come from the `swagger-ui-bundle`
package (Swagger UI's release files, installed with us) under /schema/assets/, never a CDN."""

from __future__ import annotations

from pathlib import Path

import swagger_ui_bundle
from litestar import Router
from litestar.openapi.plugins import SwaggerRenderPlugin
from litestar.static_files import create_static_files_router

ASSETS = "/schema/assets"
ASSET_FILES = (
    "swagger-ui-bundle.js",
    "swagger-ui-standalone-preset.js",
    "swagger-ui.css",
    "favicon-32x32.png",
)


def swagger_ui() -> SwaggerRenderPlugin:
    return SwaggerRenderPlugin(
        path="/swagger",
        js_url=f"{ASSETS}/swagger-ui-bundle.js",
        css_url=f"{ASSETS}/swagger-ui.css",
        standalone_preset_js_url=f"{ASSETS}/swagger-ui-standalone-preset.js",
        favicon=f"<link rel='icon' type='image/png' href='{ASSETS}/favicon-32x32.png'>",
    )


def assets_router() -> Router:
    return create_static_files_router(
        path=ASSETS,
        directories=[Path(swagger_ui_bundle.swagger_ui_path)],
        include_in_schema=False,
        name="api-docs-assets",
    )
