"""The web console: read-only pages over the inventory, served by the API server (docs/console.md)."""

from __future__ import annotations

from pathlib import Path

from litestar.config.app import AppConfig
from litestar.plugins import InitPluginProtocol

HERE = Path(__file__).resolve().parent
STATIC_DIR = HERE / "static"
TEMPLATE_DIR = HERE / "templates"


class ConsolePlugin(InitPluginProtocol):
    """Adds the console's routes and its Jinja template engine to the app."""

    def on_app_init(self, app_config: AppConfig) -> AppConfig:
        from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
        from litestar.plugins.jinja import JinjaTemplateEngine
        from litestar.template.config import TemplateConfig

        from api.http.console import views
        from api.http.console.routes import console_routers
        from api.services import wording

        env = Environment(
            loader=FileSystemLoader(TEMPLATE_DIR),
            autoescape=select_autoescape(default=True),
            undefined=StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        env.filters.update(
            age=views.age,
            skew=views.skew,
            moment=views.moment,
            form_moment=views.form_moment,
            bytes=wording.human_bytes,
            gpu_ordered=wording.gpu_ordered,
        )
        env.globals.update(
            fact_view=wording.fact_view,
            fact_label=wording.fact_label,
            event_lines=wording.event_lines,
            signal_rows=wording.signal_rows,
            stream_view=wording.stream_view,
            xid_meaning=wording.xid_meaning,
        )
        app_config.template_config = TemplateConfig(instance=JinjaTemplateEngine(engine_instance=env))
        app_config.route_handlers.extend(console_routers())
        return app_config
