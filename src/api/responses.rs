//! Response bodies of the subscription endpoints beyond the bare [`SubscriptionView`], and the
//! rotate request.
//!
//! A plaintext signing secret appears in exactly two shapes, [`CreatedSubscription`] and
//! [`RotatedSecret`], each the answer to the request that made the secret. Both hold it as a
//! [`Secret`], so their `Debug` prints `[redacted]`; only serialization to the client exposes it.
use serde::{Deserialize, Serialize, Serializer};
use utoipa::ToSchema;

use crate::runtime::secret::Secret;
use crate::subscriptions::model::{SubscriptionView, VerificationStateView};

fn expose<S: Serializer>(secret: &Option<Secret>, s: S) -> Result<S::Ok, S::Error> {
    match secret {
        Some(secret) => s.serialize_str(secret.expose()),
        None => s.serialize_none(),
    }
}

fn expose_one<S: Serializer>(secret: &Secret, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(secret.expose())
}

/// What a verification probe concluded, when one ran during the request.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct VerificationOutcome {
    /// The subscription's `verification_state` after the probe.
    pub state: VerificationStateView,
    /// Why the probe failed (`challenge_missing`, `bad_status`, `connect_failed`, `timeout`, …),
    /// or why none is known yet on create: `not_yet_visible` (`202`), `not_recorded` (the
    /// verdict's write failed; probed again in the background), `probe_deferred` (no probe now:
    /// the tenant's or the instance's probes were all in use; probed in the background).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl VerificationOutcome {
    pub fn passed() -> VerificationOutcome {
        VerificationOutcome {
            state: VerificationStateView::Active,
            error_code: None,
            message: None,
        }
    }

    /// The verdict a stored state stands for, without the probe's details.
    pub fn of_state(state: crate::runtime::records::VerificationState) -> VerificationOutcome {
        VerificationOutcome {
            state: state.into(),
            error_code: None,
            message: None,
        }
    }

    /// The probe was not run now (the tenant's or the instance's probes were all in use).
    pub fn deferred() -> VerificationOutcome {
        VerificationOutcome {
            state: VerificationStateView::Pending,
            error_code: Some("probe_deferred".into()),
            message: Some(
                "too many verification probes were running; it is probed in the background \
                 within a minute (or call POST /v1/subscriptions/{id}/verify)"
                    .into(),
            ),
        }
    }

    /// The probe's verdict could not be written (the control topic refused or lagged): the
    /// subscription stays `pending` and is probed again in the background.
    pub fn unrecorded() -> VerificationOutcome {
        VerificationOutcome {
            state: VerificationStateView::Pending,
            error_code: Some("not_recorded".into()),
            message: Some(
                "the probe's verdict could not be written; it is probed again in the background"
                    .into(),
            ),
        }
    }

    /// No probe ran: the subscription is on the control topic but not yet in this instance's
    /// table (`202`); the background retrier probes it.
    pub fn not_yet_visible() -> VerificationOutcome {
        VerificationOutcome {
            state: VerificationStateView::Pending,
            error_code: Some("not_yet_visible".into()),
            message: Some(
                "written, not yet visible to this instance; it is probed in the background".into(),
            ),
        }
    }
}

/// `201` of `POST /v1/subscriptions`: the subscription, its signing secret (webhooks; shown this
/// once) and the result of the verification probe.
#[derive(Debug, Serialize, ToSchema)]
pub struct CreatedSubscription {
    #[serde(flatten)]
    pub subscription: SubscriptionView,
    /// `whsec_…`: store it now, it is never shown again (rotate to get a new one).
    #[serde(serialize_with = "expose", skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>, example = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")]
    pub signing_secret: Option<Secret>,
    pub verification: VerificationOutcome,
}

/// `200` of `PATCH` and of `POST …/verify`: the subscription and, when a probe ran, its result.
#[derive(Debug, Serialize, ToSchema)]
pub struct CheckedSubscription {
    #[serde(flatten)]
    pub subscription: SubscriptionView,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verification: Option<VerificationOutcome>,
}

/// `200` of `GET /v1/subscriptions`: one page, ordered by id (creation order).
#[derive(Debug, Serialize, ToSchema)]
pub struct SubscriptionPage {
    pub data: Vec<SubscriptionView>,
    /// Pass as `cursor` for the next page; absent on the last page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// Optional body of `POST …/rotate-secret`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RotateSecretRequest {
    /// How long the previous secret stays valid (humantime, at most `168h`); default
    /// `STREAMING_HUB_SECRET_ROTATION_GRACE`.
    #[schema(example = "24h")]
    pub grace: Option<String>,
}

/// `200` of `POST …/rotate-secret`.
#[derive(Debug, Serialize, ToSchema)]
pub struct RotatedSecret {
    /// The new current secret, `whsec_…`; shown this once.
    #[serde(serialize_with = "expose_one")]
    #[schema(value_type = String)]
    pub signing_secret: Secret,
    /// Until when the previous secret still signs deliveries (RFC 3339).
    pub previous_secret_expires_at: String,
    pub subscription: SubscriptionView,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_bearing_responses_redact_in_debug_and_expose_only_in_json() {
        let r = RotateSecretRequest::default();
        assert!(r.grace.is_none());
        let rotated = RotatedSecret {
            signing_secret: Secret::new("whsec_plaintext"),
            previous_secret_expires_at: "2025-01-01T00:00:00.000Z".into(),
            subscription: sample_view(),
        };
        assert!(!format!("{rotated:?}").contains("whsec_plaintext"));
        assert_eq!(
            serde_json::to_value(&rotated).unwrap()["signing_secret"],
            "whsec_plaintext"
        );
        let created = CreatedSubscription {
            subscription: sample_view(),
            signing_secret: None,
            verification: VerificationOutcome::passed(),
        };
        let json = serde_json::to_value(&created).unwrap();
        assert!(
            json.get("signing_secret").is_none(),
            "pull destinations have no secret"
        );
        assert_eq!(json["id"], "s1", "the view is flattened into the response");
    }

    fn sample_view() -> SubscriptionView {
        use crate::runtime::records::*;
        SubscriptionView::of(&SubscriptionRecord::pull("s1", "t", &["*"]), vec![])
    }
}
