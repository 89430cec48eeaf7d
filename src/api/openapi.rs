//! `GET /openapi.json`: the OpenAPI 3 document of the whole API, generated from the code with
//! `utoipa` (each handler's `#[utoipa::path]` and each body's `ToSchema`), so it cannot drift from
//! what the router serves; the tests check every route is in it and every `$ref` resolves.
use std::sync::OnceLock;

use axum::http::header;
use axum::response::IntoResponse;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::errors::{ErrorBody, ErrorDetail};
use super::ops::{DeadPage, ForensicPage, RecoverRequest, RedriveRequest, ReplayRequest};
use super::responses::{
    CheckedSubscription, CreatedSubscription, RotateSecretRequest, RotatedSecret, SubscriptionPage,
    VerificationOutcome,
};
use super::{ops, secrets, subscriptions, verification};
use crate::ops::forensics::{DeadDelivery, ForensicRecord, HeaderText};
use crate::ops::pull::{EventPage, PulledEvent};
use crate::ops::redeliver::Progress;
use crate::subscriptions::model::{
    CreateSubscription, DestinationPatch, DestinationSpec, DestinationView, PatchSubscription,
    SubscriptionView, VerificationStateView,
};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Streaming Hub API",
        description = "Tenant subscriptions to CloudEvents delivered as signed webhooks or kept for pull. \
            Every /v1 call needs `Authorization: Bearer <JWT>` (HS256): a tenant token acts for its \
            tenant; an admin token names the tenant with `tenant_id`. Errors are \
            `{\"error\":{\"code\",\"message\",\"field\"}}`."
    ),
    paths(
        subscriptions::create,
        subscriptions::list,
        subscriptions::get_one,
        subscriptions::patch,
        subscriptions::delete,
        verification::verify,
        secrets::rotate,
        ops::recover,
        ops::pull_events,
        ops::start_replay,
        ops::replay_status,
        ops::producer_dlq,
        ops::quarantine,
        ops::dead_deliveries,
        ops::redrive,
        serve,
    ),
    components(schemas(
        CreateSubscription, PatchSubscription, DestinationSpec, DestinationPatch, SubscriptionView, DestinationView,
        VerificationStateView, CreatedSubscription, CheckedSubscription, SubscriptionPage, VerificationOutcome,
        RotateSecretRequest, RotatedSecret, ErrorBody, ErrorDetail,
        EventPage, PulledEvent, RecoverRequest, ReplayRequest, RedriveRequest, Progress,
        ForensicPage, ForensicRecord, HeaderText, DeadPage, DeadDelivery,
    )),
    modifiers(&BearerAuth),
    tags(
        (name = "subscriptions", description = "Who receives which events, and where"),
        (name = "pull", description = "Reading a pull subscription's events"),
        (name = "admin", description = "Operators: replay, forensics, redrive (admin token)")
    )
)]
pub struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let scheme = HttpBuilder::new()
            .scheme(HttpAuthScheme::Bearer)
            .bearer_format("JWT")
            .build();
        doc.components
            .get_or_insert_with(Default::default)
            .add_security_scheme("bearer", SecurityScheme::Http(scheme));
    }
}

/// The document as JSON, built once.
pub fn document() -> &'static str {
    static DOC: OnceLock<String> = OnceLock::new();
    DOC.get_or_init(|| {
        ApiDoc::openapi()
            .to_pretty_json()
            .expect("the OpenAPI document serializes")
    })
}

#[utoipa::path(get, path = "/openapi.json", tag = "meta",
    responses((status = 200, description = "This document (OpenAPI 3)", content_type = "application/json")))]
pub async fn serve() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], document())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refs(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("$ref", serde_json::Value::String(r)) => out.push(r.clone()),
                        _ => refs(v, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }

    #[test]
    fn document_covers_every_route_and_every_reference_resolves() {
        let doc: serde_json::Value = serde_json::from_str(document()).unwrap();
        assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
        let routes = [
            ("/v1/subscriptions", &["post", "get"][..]),
            ("/v1/subscriptions/{id}", &["get", "patch", "delete"][..]),
            ("/v1/subscriptions/{id}/verify", &["post"][..]),
            ("/v1/subscriptions/{id}/rotate-secret", &["post"][..]),
            ("/v1/subscriptions/{id}/recover", &["post"][..]),
            ("/v1/events", &["get"][..]),
            ("/admin/replay", &["post"][..]),
            ("/admin/replay/{id}", &["get"][..]),
            ("/admin/dlq", &["get"][..]),
            ("/admin/quarantine", &["get"][..]),
            ("/admin/deliveries/dead", &["get"][..]),
            ("/admin/deliveries/dead/redrive", &["post"][..]),
            ("/openapi.json", &["get"][..]),
        ];
        for (path, methods) in routes {
            for m in methods {
                assert!(doc["paths"][path][m].is_object(), "{m} {path} missing");
            }
        }
        assert_eq!(
            doc["paths"].as_object().unwrap().len(),
            routes.len(),
            "a documented path that is not routed"
        );
        let mut all = Vec::new();
        refs(&doc, &mut all);
        assert!(all.len() > 10);
        for r in all {
            let name = r
                .strip_prefix("#/components/schemas/")
                .expect("a schema reference");
            assert!(
                doc["components"]["schemas"][name].is_object(),
                "dangling {r}"
            );
        }
        assert_eq!(
            doc["components"]["securitySchemes"]["bearer"]["scheme"],
            "bearer"
        );
        assert!(doc["paths"]["/v1/subscriptions"]["post"]["security"].is_array());
    }
}
