//! Create, list, read, patch and delete: status codes, versions, `If-Match`, pagination.
use axum::http::{Method, StatusCode};
use serde_json::json;

use super::{Harness, pull_body};
use crate::runtime::records::VerificationState;

#[tokio::test]
async fn pull_subscription_is_created_active_with_a_uuidv7_id_and_no_secret() {
    let h = Harness::new();
    let body = json!({
        "origin": "ledger", "event_types": ["transaction.created", "account.*"], "schema_major": 2,
        "destination": {"type": "pull"}, "retry_schedule": ["5s", "10m"], "enabled": true
    });
    let a = h.post("/v1/subscriptions", &h.token("acme"), body).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    let id = a.body["id"].as_str().unwrap();
    assert_eq!(uuid::Uuid::parse_str(id).unwrap().get_version_num(), 7);
    assert_eq!(
        a.headers["location"],
        format!("/v1/subscriptions/{id}").as_str()
    );
    assert_eq!(a.headers["etag"], "\"1\"");
    assert_eq!(a.body["tenant_id"], "acme");
    assert_eq!(a.body["verification_state"], "active");
    assert_eq!(a.body["verification"]["state"], "active");
    assert_eq!(a.body["destination"], json!({"type": "pull"}));
    assert_eq!(a.body["retry_schedule"], json!(["5s", "10m"]));
    assert_eq!(a.body["created_at"], "2025-06-15T15:06:40.000Z");
    assert_eq!(a.body["version"], 1);
    assert!(a.body.get("signing_secret").is_none());
    let stored = h.state.subs.get(id).unwrap();
    assert_eq!(stored.retry_schedule, Some(vec![5_000, 600_000]));
    assert_eq!(stored.verification_state, VerificationState::Active);
    assert!(stored.signing_secrets.is_empty());
}

#[tokio::test]
async fn get_returns_the_view_with_its_version_as_etag() {
    let h = Harness::new();
    let id = h.create_pull("acme").await;
    let a = h
        .get(&format!("/v1/subscriptions/{id}"), &h.token("acme"))
        .await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.headers["etag"], "\"1\"");
    assert_eq!(a.body["id"], id.as_str());
    assert_eq!(a.body["event_types"], json!(["transaction.created"]));
    assert!(a.body.get("signing_secrets").is_none());
}

#[tokio::test]
async fn unknown_id_is_404_with_a_json_error() {
    let h = Harness::new();
    let a = h
        .get(
            "/v1/subscriptions/0190a000-0000-7000-8000-000000000000",
            &h.token("acme"),
        )
        .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert_eq!(a.body["error"]["code"], "not_found");
}

#[tokio::test]
async fn list_pages_by_id_with_next_cursor_and_shows_only_the_callers_tenant() {
    let h = Harness::new();
    let mut mine = Vec::new();
    for _ in 0..5 {
        mine.push(h.create_pull("acme").await);
        h.create_pull("other").await;
    }
    let token = h.token("acme");
    let first = h.get("/v1/subscriptions?limit=2", &token).await;
    assert_eq!(first.status, StatusCode::OK);
    let ids = |a: &super::Answer| {
        a.body["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(ids(&first), mine[..2]);
    let cursor = first.body["next_cursor"].as_str().unwrap().to_string();
    let second = h
        .get(
            &format!("/v1/subscriptions?limit=2&cursor={cursor}"),
            &token,
        )
        .await;
    assert_eq!(ids(&second), mine[2..4]);
    let cursor = second.body["next_cursor"].as_str().unwrap().to_string();
    let last = h
        .get(
            &format!("/v1/subscriptions?limit=2&cursor={cursor}"),
            &token,
        )
        .await;
    assert_eq!(ids(&last), mine[4..]);
    assert!(
        last.body.get("next_cursor").is_none(),
        "last page has no cursor"
    );
    let all = h.get("/v1/subscriptions", &token).await;
    assert_eq!(ids(&all), mine);
    for bad in ["0", "201", "x"] {
        let a = h
            .get(&format!("/v1/subscriptions?limit={bad}"), &token)
            .await;
        assert_eq!(
            (a.status, a.body["error"]["field"].as_str()),
            (StatusCode::BAD_REQUEST, Some("limit")),
            "{bad}"
        );
    }
}

#[tokio::test]
async fn admin_acts_only_for_the_tenant_it_names() {
    let h = Harness::new();
    let admin = h.admin_token();
    let a = h.post("/v1/subscriptions", &admin, pull_body()).await;
    assert_eq!(
        (a.status, a.body["error"]["field"].as_str()),
        (StatusCode::BAD_REQUEST, Some("tenant_id"))
    );
    let mut body = pull_body();
    body["tenant_id"] = json!("acme");
    let a = h.post("/v1/subscriptions", &admin, body).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    assert_eq!(a.body["tenant_id"], "acme");
    let id = a.body["id"].as_str().unwrap().to_string();
    let a = h.get("/v1/subscriptions", &admin).await;
    assert_eq!(a.body["error"]["field"], "tenant_id");
    let a = h.get("/v1/subscriptions?tenant_id=acme", &admin).await;
    assert_eq!(a.body["data"][0]["id"], id.as_str());
    assert_eq!(
        h.get(&format!("/v1/subscriptions/{id}?tenant_id=acme"), &admin)
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        h.get(&format!("/v1/subscriptions/{id}?tenant_id=other"), &admin)
            .await
            .status,
        StatusCode::NOT_FOUND
    );
}

/// A create names its tenant in the body or the query, as every other route takes it. The query
/// was ignored on create: an admin token carrying a tenant of its own (`token --tenant ops
/// --admin`) made the subscription for `ops`, whose events then went to acme's endpoint.
/// Recover names its tenant in the body or the query, as create does (the query was ignored: an
/// admin token with a tenant of its own looked the subscription up under that one, a 404).
#[tokio::test]
async fn an_admin_recover_takes_the_tenant_its_query_names() {
    let h = Harness::new();
    let hook = super::Hook::start(true).await;
    let id = h.create_webhook(&h.token("acme"), &hook.url).await;
    let admin = h.admin_token_with_tenant("ops");
    let since = json!({"since": "2026-01-01T00:00:00Z"});
    let uri = format!("/v1/subscriptions/{id}/recover");
    let own = h.post(&uri, &admin, since.clone()).await;
    assert_eq!(
        own.status,
        StatusCode::NOT_FOUND,
        "ops has no such subscription"
    );
    // Found under acme; this harness runs no operations (no Kafka), which answers 503.
    let a = h
        .post(&format!("{uri}?tenant_id=acme"), &admin, since)
        .await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{}", a.text);
    let both = json!({"since": "2026-01-01T00:00:00Z", "tenant_id": "acme"});
    let a = h
        .post(&format!("{uri}?tenant_id=other"), &admin, both)
        .await;
    assert_eq!(
        (a.status, a.body["error"]["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("tenant_mismatch"))
    );
}

/// A recover or replay to a subscription the hub would drop every redelivery for (disabled,
/// verification pending or failed) is refused with `409`, not answered as queued.
#[tokio::test]
async fn recover_and_replay_of_an_inactive_subscription_are_refused() {
    let h = Harness::new();
    let hook = super::Hook::start(true).await;
    let token = h.token("acme");
    let admin = h.admin_token();
    let id = h.create_webhook(&token, &hook.url).await;
    let recover = format!("/v1/subscriptions/{id}/recover");
    let since = json!({"since": "2026-01-01T00:00:00Z"});
    let replay = json!({"subscription_id": id, "from": "2026-01-01T00:00:00Z"});
    let states = [
        (false, VerificationState::Active, "disabled"),
        (true, VerificationState::Pending, "pending"),
        (true, VerificationState::Failed, "failed verification"),
    ];
    for (enabled, state, why) in states {
        let mut rec = (*h.state.subs.get(&id).unwrap()).clone();
        (rec.enabled, rec.verification_state, rec.version) = (enabled, state, rec.version + 1);
        h.state.subs.put(rec).await.unwrap();
        for a in [
            h.post(&recover, &token, since.clone()).await,
            h.post("/admin/replay", &admin, replay.clone()).await,
        ] {
            assert_eq!(
                (a.status, a.body["error"]["code"].as_str()),
                (StatusCode::CONFLICT, Some("subscription_inactive")),
                "{why}: {}",
                a.text
            );
            assert!(a.text.contains(why), "{}", a.text);
        }
    }
    // Enabled and active: past the check (this harness runs no operations: 503).
    let mut rec = (*h.state.subs.get(&id).unwrap()).clone();
    (rec.enabled, rec.verification_state, rec.version) =
        (true, VerificationState::Active, rec.version + 1);
    h.state.subs.put(rec).await.unwrap();
    // Unless its latest record cannot be read here: the version this instance has may be stale,
    // and the hub holds that subscription's deliveries.
    (h.state.subs.table()).apply(|t| t.read_unreadable(&id, 0, 99));
    for a in [
        h.post(&recover, &token, since.clone()).await,
        h.post("/admin/replay", &admin, replay.clone()).await,
    ] {
        assert_eq!(
            (a.status, a.body["error"]["code"].as_str()),
            (StatusCode::CONFLICT, Some("record_unreadable")),
            "{}",
            a.text
        );
    }
    let rec = (*h.state.subs.get(&id).unwrap()).clone();
    (h.state.subs.table()).apply(|t| t.read_record(&id, Some(rec), 0, 100)); // readable again
    let a = h.post(&recover, &token, since).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{}", a.text);
    let a = h.post("/admin/replay", &admin, replay).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{}", a.text);
}

/// Every instance holds every subscription in memory: a tenant's creates stop at the limit.
#[tokio::test]
async fn a_create_past_the_tenants_limit_is_409_and_a_delete_makes_room() {
    let mut h = Harness::new();
    assert_eq!(h.state.max_subscriptions_per_tenant, 1000, "the default");
    h.state.max_subscriptions_per_tenant = 3;
    let token = h.token("acme");
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(h.create_pull("acme").await);
    }
    let a = h.post("/v1/subscriptions", &token, pull_body()).await;
    assert_eq!(
        (a.status, a.body["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("subscription_limit")),
        "{}",
        a.text
    );
    assert_eq!(h.state.subs.list("acme").len(), 3, "nothing written");
    let other = h
        .post("/v1/subscriptions", &h.token("other"), pull_body())
        .await;
    assert_eq!(
        other.status,
        StatusCode::CREATED,
        "another tenant's own count"
    );
    let uri = format!("/v1/subscriptions/{}", ids[0]);
    let a = h.call(Method::DELETE, &uri, Some(&token), None, &[]).await;
    assert_eq!(a.status, StatusCode::NO_CONTENT);
    let a = h.post("/v1/subscriptions", &token, pull_body()).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    h.state.max_subscriptions_per_tenant = 0;
    let a = h.post("/v1/subscriptions", &token, pull_body()).await;
    assert_eq!(a.status, StatusCode::CREATED, "0: no limit");
}

/// Each pull subscription keeps its own copy of the events it matches: a tenant's pull
/// subscriptions have a limit of their own, which webhooks and other tenants do not count
/// against.
#[tokio::test]
async fn a_pull_create_past_the_tenants_pull_limit_is_409_naming_the_type() {
    let mut h = Harness::new();
    assert_eq!(h.state.max_pull_subscriptions_per_tenant, 20, "the default");
    h.state.max_pull_subscriptions_per_tenant = 2;
    let token = h.token("acme");
    let ids = [h.create_pull("acme").await, h.create_pull("acme").await];
    let a = h.post("/v1/subscriptions", &token, pull_body()).await;
    assert_eq!(
        (
            a.status,
            a.body["error"]["code"].as_str(),
            a.body["error"]["field"].as_str()
        ),
        (
            StatusCode::CONFLICT,
            Some("subscription_limit"),
            Some("destination.type")
        ),
        "{}",
        a.text
    );
    assert_eq!(h.state.subs.list("acme").len(), 2, "nothing written");
    let hook = super::Hook::start(true).await;
    h.create_webhook(&token, &hook.url).await;
    let other = h
        .post("/v1/subscriptions", &h.token("other"), pull_body())
        .await;
    assert_eq!(other.status, StatusCode::CREATED, "{}", other.text);
    let uri = format!("/v1/subscriptions/{}", ids[0]);
    let a = h.call(Method::DELETE, &uri, Some(&token), None, &[]).await;
    assert_eq!(a.status, StatusCode::NO_CONTENT);
    let a = h.post("/v1/subscriptions", &token, pull_body()).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    h.state.max_pull_subscriptions_per_tenant = 0;
    let a = h.post("/v1/subscriptions", &token, pull_body()).await;
    assert_eq!(a.status, StatusCode::CREATED, "0: no limit of its own");
}

#[tokio::test]
async fn an_admin_create_takes_the_tenant_its_query_names() {
    let h = Harness::new();
    let admin = h.admin_token_with_tenant("ops");
    let a = h
        .post("/v1/subscriptions?tenant_id=acme", &admin, pull_body())
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    assert_eq!(a.body["tenant_id"], "acme");
    let a = h.post("/v1/subscriptions", &admin, pull_body()).await;
    assert_eq!(
        a.body["tenant_id"], "ops",
        "no tenant named: the token's own"
    );
    let mut body = pull_body();
    body["tenant_id"] = json!("acme");
    let a = h
        .post("/v1/subscriptions?tenant_id=acme", &admin, body.clone())
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "the same tenant twice");
    let a = h
        .post("/v1/subscriptions?tenant_id=other", &admin, body)
        .await;
    assert_eq!(
        (
            a.status,
            a.body["error"]["code"].as_str(),
            a.body["error"]["field"].as_str()
        ),
        (
            StatusCode::BAD_REQUEST,
            Some("tenant_mismatch"),
            Some("tenant_id")
        )
    );
    // A tenant token naming another tenant in the query is refused as in the body.
    let a = h
        .post(
            "/v1/subscriptions?tenant_id=other",
            &h.token("acme"),
            pull_body(),
        )
        .await;
    assert_eq!(
        (a.status, a.body["error"]["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("tenant_not_allowed"))
    );
}

#[tokio::test]
async fn patch_changes_given_fields_clears_nulls_and_increments_the_version() {
    let h = Harness::new();
    let token = h.token("acme");
    let mut body = pull_body();
    body["origin"] = json!("ledger");
    body["schema_major"] = json!(1);
    let id = h.post("/v1/subscriptions", &token, body).await.body["id"]
        .as_str()
        .unwrap()
        .to_string();
    let uri = format!("/v1/subscriptions/{id}");
    let patch =
        json!({"event_types": ["*"], "origin": null, "retry_schedule": ["1m"], "enabled": false});
    let a = h
        .call(Method::PATCH, &uri, Some(&token), Some(patch), &[])
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    assert_eq!(a.body["version"], 2);
    assert_eq!(a.headers["etag"], "\"2\"");
    assert_eq!(a.body["event_types"], json!(["*"]));
    assert_eq!(a.body["origin"], json!(null));
    assert_eq!(a.body["schema_major"], 1, "absent fields stay");
    assert_eq!(a.body["enabled"], false);
    assert!(
        a.body.get("verification").is_none(),
        "no URL change, no probe"
    );
    let stored = h.state.subs.get(&id).unwrap();
    assert_eq!(
        (
            stored.version,
            stored.origin.clone(),
            stored.retry_schedule.clone()
        ),
        (2, None, Some(vec![60_000]))
    );
    let same = h
        .call(
            Method::PATCH,
            &uri,
            Some(&token),
            Some(json!({"enabled": false})),
            &[],
        )
        .await;
    assert_eq!(
        same.body["version"], 2,
        "a patch that changes nothing writes nothing"
    );
}

#[tokio::test]
async fn patch_with_a_stale_if_match_is_412_and_with_the_current_one_applies() {
    let h = Harness::new();
    let token = h.token("acme");
    let id = h.create_pull("acme").await;
    let uri = format!("/v1/subscriptions/{id}");
    let first = h
        .call(
            Method::PATCH,
            &uri,
            Some(&token),
            Some(json!({"enabled": false})),
            &[("if-match", "\"1\"")],
        )
        .await;
    assert_eq!(first.status, StatusCode::OK);
    let stale = h
        .call(
            Method::PATCH,
            &uri,
            Some(&token),
            Some(json!({"enabled": true})),
            &[("if-match", "\"1\"")],
        )
        .await;
    assert_eq!(stale.status, StatusCode::PRECONDITION_FAILED);
    assert_eq!(stale.body["error"]["code"], "version_mismatch");
    assert_eq!(stale.body["error"]["field"], "If-Match");
    assert!(
        !h.state.subs.get(&id).unwrap().enabled,
        "the stale patch changed nothing"
    );
    let bad = h
        .call(
            Method::PATCH,
            &uri,
            Some(&token),
            Some(json!({"enabled": true})),
            &[("if-match", "two")],
        )
        .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    let ok = h
        .call(
            Method::PATCH,
            &uri,
            Some(&token),
            Some(json!({"enabled": true})),
            &[("if-match", "2")],
        )
        .await;
    assert_eq!(
        (ok.status, ok.body["version"].as_u64()),
        (StatusCode::OK, Some(3))
    );
}

/// A conditional delete: `If-Match` naming another version is 412 and deletes nothing (it was
/// ignored: a client that read version 1 deleted the version 2 another one had just written).
#[tokio::test]
async fn delete_with_a_stale_if_match_is_412_and_with_the_current_one_deletes() {
    let h = Harness::new();
    let token = h.token("acme");
    let id = h.create_pull("acme").await;
    let uri = format!("/v1/subscriptions/{id}");
    let version = h.state.subs.get(&id).unwrap().version;
    let delete = |v: u64| {
        let if_match = format!("\"{v}\"");
        let (h, uri, token) = (&h, uri.clone(), token.clone());
        async move {
            h.call(
                Method::DELETE,
                &uri,
                Some(&token),
                None,
                &[("if-match", &if_match)],
            )
            .await
        }
    };
    let a = delete(version + 1).await;
    assert_eq!(a.status, StatusCode::PRECONDITION_FAILED, "{}", a.text);
    assert_eq!(a.body["error"]["field"], "If-Match");
    assert!(h.state.subs.get(&id).is_some(), "nothing deleted");
    let a = delete(version).await;
    assert_eq!(a.status, StatusCode::NO_CONTENT, "{}", a.text);
    assert!(h.state.subs.get(&id).is_none());
}

#[tokio::test]
async fn patch_enabling_a_disabled_subscription_clears_the_disable_reason() {
    let h = Harness::new();
    let id = h.create_pull("acme").await;
    let mut rec = (*h.state.subs.get(&id).unwrap()).clone();
    (
        rec.enabled,
        rec.disabled_reason,
        rec.disabled_at,
        rec.version,
    ) = (false, Some("failing for 120h".into()), Some(START), 2);
    h.state.subs.put(rec).await.unwrap();
    let a = h
        .call(
            Method::PATCH,
            &format!("/v1/subscriptions/{id}"),
            Some(&h.token("acme")),
            Some(json!({"enabled": true})),
            &[],
        )
        .await;
    assert_eq!(a.body["enabled"], true);
    assert_eq!(
        (
            a.body["disabled_reason"].clone(),
            a.body["disabled_at"].clone()
        ),
        (json!(null), json!(null))
    );
}

const START: i64 = super::START_MS;

#[tokio::test]
async fn patch_cannot_change_the_destination_type() {
    let h = Harness::new();
    let id = h.create_pull("acme").await;
    let patch = json!({"destination": {"type": "webhook", "url": "http://127.0.0.1:9/hook"}});
    let a = h
        .call(
            Method::PATCH,
            &format!("/v1/subscriptions/{id}"),
            Some(&h.token("acme")),
            Some(patch),
            &[],
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        (
            a.body["error"]["code"].as_str(),
            a.body["error"]["field"].as_str()
        ),
        (Some("immutable"), Some("destination.type"))
    );
}

#[tokio::test]
async fn delete_is_204_and_the_subscription_is_gone() {
    let h = Harness::new();
    let token = h.token("acme");
    let id = h.create_pull("acme").await;
    let uri = format!("/v1/subscriptions/{id}");
    let a = h.call(Method::DELETE, &uri, Some(&token), None, &[]).await;
    assert_eq!(a.status, StatusCode::NO_CONTENT);
    assert!(a.text.is_empty());
    assert!(h.state.subs.get(&id).is_none());
    assert_eq!(h.get(&uri, &token).await.status, StatusCode::NOT_FOUND);
    assert_eq!(
        h.call(Method::DELETE, &uri, Some(&token), None, &[])
            .await
            .status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn openapi_document_is_served_without_a_token() {
    let h = Harness::new();
    let a = h.call(Method::GET, "/openapi.json", None, None, &[]).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.headers["content-type"], "application/json");
    assert!(a.body["paths"]["/v1/subscriptions/{id}/rotate-secret"]["post"].is_object());
    // A PATCH destination's fields may be left out, never null (a 400): the document says so,
    // or clients generated from it send null.
    let patch = a.body["components"]["schemas"]["DestinationPatch"].to_string();
    for field in ["url", "headers", "sensitive_headers"] {
        assert!(patch.contains(&format!("\"{field}\"")), "{field}: {patch}");
    }
    assert!(!patch.contains("null"), "{patch}");
}

#[tokio::test]
async fn every_subscription_call_is_503_until_the_table_has_read_the_control_topic() {
    let h = Harness::loading();
    let t = h.token("acme");
    let id = "0190a000-0000-7000-8000-000000000000";
    let one = format!("/v1/subscriptions/{id}");
    let body = pull_body();
    let replay = json!({"subscription_id": id, "from": "2026-01-01T00:00:00Z"});
    let answers = [
        h.post("/v1/subscriptions", &t, body.clone()).await,
        h.get("/v1/subscriptions", &t).await,
        h.get(&one, &t).await,
        h.call(
            Method::PATCH,
            &one,
            Some(&t),
            Some(json!({"enabled": false})),
            &[],
        )
        .await,
        h.call(Method::DELETE, &one, Some(&t), None, &[]).await,
        h.post(&format!("{one}/rotate-secret"), &t, json!({})).await,
        h.post(&format!("{one}/verify"), &t, json!({})).await,
        h.post("/admin/replay", &h.admin_token(), replay.clone())
            .await,
    ];
    for a in &answers {
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{}", a.text);
        assert_eq!(a.body["error"]["code"], "unavailable", "{}", a.text);
    }
    // Nothing was written meanwhile, and the same calls are served once it has caught up.
    assert!(h.state.subs.table().read().iter().next().is_none());
    h.state.subs.table().set_caught_up();
    assert_eq!(h.get("/v1/subscriptions", &t).await.status, StatusCode::OK);
    assert_eq!(h.get(&one, &t).await.status, StatusCode::NOT_FOUND);
    let a = h.post("/admin/replay", &h.admin_token(), replay).await;
    assert_eq!(a.status, StatusCode::NOT_FOUND, "{}", a.text);
    let a = h.post("/v1/subscriptions", &t, body).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
}

/// The control topic took the write but this instance has not read it back in time: the change
/// is made, so it is not answered as a failure (a retry with the same `If-Match` would be 412).
#[tokio::test]
async fn an_update_or_delete_not_yet_seen_back_is_accepted_not_503() {
    let h = Harness::lagging();
    let t = h.token("acme");
    let created = h.post("/v1/subscriptions", &t, pull_body()).await;
    assert_eq!(created.status, StatusCode::ACCEPTED, "{}", created.text);
    let id = created.body["id"].as_str().unwrap();
    let one = format!("/v1/subscriptions/{id}");
    let patched = h
        .call(
            Method::PATCH,
            &one,
            Some(&t),
            Some(json!({"enabled": false})),
            &[("if-match", "\"1\"")],
        )
        .await;
    assert_eq!(patched.status, StatusCode::ACCEPTED, "{}", patched.text);
    assert_eq!(patched.headers["etag"], "\"2\"");
    assert_eq!(patched.body["enabled"], false, "{}", patched.text);
    // This instance goes on from the version it wrote.
    let got = h.get(&one, &t).await;
    assert_eq!(got.headers["etag"], "\"2\"", "{}", got.text);
    let deleted = h.call(Method::DELETE, &one, Some(&t), None, &[]).await;
    assert_eq!(deleted.status, StatusCode::NO_CONTENT, "{}", deleted.text);
}
