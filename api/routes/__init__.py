"""API routers, one module per resource; `api.app.create_app` includes them (results first: routes are
matched in registration order and intake is the hot path)."""
