//! `GET /openapi.json`: the OpenAPI 3 document of the whole API, generated from the code with
//! `utoipa` (each handler's `#[utoipa::path]` and each body's `ToSchema`), so it cannot drift from
//! what the router serves; the tests check every route is in it and every `$ref` resolves.
//!
//! The answers of the shared extractors are added to every operation that uses them by
//! [`ExtractorErrors`], so no handler's list can forget one; each handler documents the answers of
//! its own logic (403, 404, 409, 412, 422, 429, 503).
use std::sync::OnceLock;

use axum::http::header;
use axum::response::IntoResponse;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
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
        ops::cancel_replay,
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
    modifiers(&BearerAuth, &ExtractorErrors),
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

/// Documents, on every operation, what the extractors it takes may answer (each an [`ErrorBody`]):
/// a bearer token ([`super::Caller`]) `401`; parameters ([`super::extract::ApiPath`],
/// [`super::extract::ApiQuery`], and `tenant_id` for [`super::Caller::tenant_for`]) or a body `400`
/// naming the field; a JSON body ([`super::extract::JsonBody`]) `413` over
/// [`super::MAX_BODY_BYTES`] and `415` without `Content-Type: application/json`. A status the
/// handler documents itself keeps its description.
struct ExtractorErrors;

impl Modify for ExtractorErrors {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let error = |description: &str| -> RefOr<utoipa::openapi::Response> {
            let body = ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("ErrorBody")))
                .build();
            ResponseBuilder::new()
                .description(description)
                .content("application/json", body)
                .build()
                .into()
        };
        for item in doc.paths.paths.values_mut() {
            let ops = [
                &mut item.get,
                &mut item.post,
                &mut item.patch,
                &mut item.delete,
            ];
            for op in ops.into_iter().flatten() {
                let secured = op.security.is_some();
                let params = op.parameters.as_ref().is_some_and(|p| !p.is_empty());
                let body = op.request_body.is_some();
                let mut add = |status: &str, description: &str| {
                    let responses = &mut op.responses.responses;
                    responses
                        .entry(status.to_string())
                        .or_insert_with(|| error(description));
                };
                if params || body {
                    add("400", "Invalid input; `field` names it");
                }
                if secured {
                    add("401", "Missing, forged or expired token");
                }
                if body {
                    add("413", "Body over 64 KiB");
                    add("415", "Body is not `Content-Type: application/json`");
                }
            }
        }
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
            ("/admin/replay/{id}", &["get", "delete"][..]),
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

    #[test]
    fn every_answer_of_the_shared_extractors_is_documented_as_an_error_body() {
        let doc: serde_json::Value = serde_json::from_str(document()).unwrap();
        let error_body = |op: &serde_json::Value, status: &str| {
            op["responses"][status]["content"]["application/json"]["schema"]["$ref"]
                == "#/components/schemas/ErrorBody"
        };
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                let params = op["parameters"].as_array().is_some_and(|p| !p.is_empty());
                let body = op.get("requestBody").is_some();
                let mut expected = Vec::new();
                if op["security"].is_array() {
                    expected.push("401");
                }
                if params || body {
                    expected.push("400");
                }
                if body {
                    expected.extend(["413", "415"]);
                }
                for status in expected {
                    assert!(error_body(op, status), "{method} {path}: {status}");
                }
            }
        }
        // What the first scripts/api-fuzz.sh run answered without the document saying so.
        for (path, method, status) in [
            ("/admin/dlq", "get", "401"),
            ("/admin/replay/{id}", "get", "401"),
            ("/v1/subscriptions/{id}", "get", "400"),
            ("/v1/subscriptions/{id}", "delete", "400"),
            ("/v1/subscriptions/{id}/verify", "post", "400"),
            ("/v1/subscriptions/{id}", "patch", "415"),
            ("/v1/subscriptions/{id}/recover", "post", "415"),
            ("/admin/replay", "post", "415"),
            ("/admin/deliveries/dead/redrive", "post", "401"),
            ("/v1/subscriptions/{id}", "delete", "503"),
        ] {
            assert!(
                error_body(&doc["paths"][path][method], status),
                "{method} {path}: {status}"
            );
        }
        let pull = doc["paths"]["/v1/events"]["get"]["parameters"]
            .as_array()
            .unwrap();
        let id = pull
            .iter()
            .find(|p| p["name"] == "subscription_id")
            .unwrap();
        assert_eq!(id["required"], true, "the handler requires it");
    }
}
