//! Bearer tokens: HS256 JWTs signed with `STREAMING_HUB_JWT_SECRET`, made by hand from
//! `hmac` + `sha2` + base64url (no JWT crate, so no `alg` confusion can creep in through one).
//!
//! A token is `base64url(header).base64url(claims).base64url(HMAC-SHA256(secret, first two parts))`
//! without padding. The header must say `"alg":"HS256"`; anything else (`none`, `HS512`, `RS256`)
//! is refused before any signature work. Claims: `tenant_id` (the caller's tenant), `admin`
//! (`true` for operators, who then name the tenant in the body or the `tenant_id` query), `exp`
//! (required, seconds since the epoch, checked against the injected clock) and `iat`. The MAC is
//! compared in constant time (`Mac::verify_slice`).
//!
//! Every refusal is `401` with code `unauthorized` (or `token_expired`) and no detail that would
//! help a forger; the reason goes to the debug log.
use std::time::Duration;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use super::ApiState;
use super::errors::{ApiError, codes};
use crate::ingest::tenant::{TENANT_RULE, check_tenant};
use crate::runtime::secret::Secret;

/// Longest `Authorization` value considered.
const MAX_TOKEN_BYTES: usize = 8 * 1024;

/// A tenant id as the hub takes it, wherever it comes from (a token, a body, an apply file, the
/// `token` command): the rule ingest holds `ce-tenantid` to ([`crate::ingest::tenant`]), 1 to 256
/// bytes, no leading or trailing whitespace, no whitespace but the ASCII space, control, format
/// or other invisible character.
pub fn valid_tenant(t: &str) -> bool {
    check_tenant(t).is_ok()
}

/// The key that signs and checks API tokens.
#[derive(Clone, Debug)]
pub struct JwtKeys {
    secret: Secret,
}

impl JwtKeys {
    pub fn new(secret: Secret) -> JwtKeys {
        JwtKeys { secret }
    }

    fn mac(&self) -> Hmac<Sha256> {
        Hmac::<Sha256>::new_from_slice(self.secret.expose().as_bytes())
            .expect("HMAC accepts keys of any length")
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    alg: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    typ: Option<String>,
}

/// The claims the hub reads; others are ignored.
#[derive(Debug, Serialize, Deserialize)]
struct Claims {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tenant_id: Option<String>,
    #[serde(default)]
    admin: bool,
    exp: i64,
    #[serde(default)]
    iat: i64,
}

/// Mints a token valid for `ttl` from now (the `streaming-hub token` command).
pub fn mint(secret: &Secret, tenant: Option<&str>, admin: bool, ttl: Duration) -> String {
    mint_at(secret, tenant, admin, ttl, chrono::Utc::now().timestamp())
}

/// [`mint`] at a given time, seconds since the epoch.
pub fn mint_at(
    secret: &Secret,
    tenant: Option<&str>,
    admin: bool,
    ttl: Duration,
    now_secs: i64,
) -> String {
    let header = Header {
        alg: "HS256".into(),
        typ: Some("JWT".into()),
    };
    let claims = Claims {
        tenant_id: tenant.map(str::to_string),
        admin,
        // A lifetime past i64 seconds is as good as forever, not negative (`as` would wrap).
        exp: now_secs.saturating_add(i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX)),
        iat: now_secs,
    };
    let header = serde_json::to_vec(&header).expect("a token header serializes");
    let claims = serde_json::to_vec(&claims).expect("token claims serialize");
    let signing_input = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(header),
        URL_SAFE_NO_PAD.encode(claims)
    );
    let mut mac = JwtKeys::new(secret.clone()).mac();
    mac.update(signing_input.as_bytes());
    format!(
        "{signing_input}.{}",
        URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
    )
}

/// Who is calling, as the token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub tenant: Option<String>,
    pub admin: bool,
}

impl Caller {
    /// The tenant this request acts for. A tenant token acts for its own tenant (naming another is
    /// refused); an admin token must name one (`named`, from the body or the query) unless the
    /// token itself carries a `tenant_id`.
    /// [`Caller::tenant_for`] the tenant named in a body or a query (routes that take both);
    /// named in both, the two must agree (`400 tenant_mismatch`).
    pub fn tenant_for_either(
        &self,
        body: Option<&str>,
        query: Option<&str>,
    ) -> Result<String, ApiError> {
        let named = match (body, query) {
            (Some(b), Some(q)) if b != q => {
                return Err(ApiError::bad_request(
                    "tenant_mismatch",
                    "tenant_id names one tenant in the body and another in the query",
                )
                .with_field("tenant_id"));
            }
            (Some(t), _) | (None, Some(t)) => Some(t),
            (None, None) => None,
        };
        self.tenant_for(named)
    }

    pub fn tenant_for(&self, named: Option<&str>) -> Result<String, ApiError> {
        let field =
            |code: &str, msg: &str| ApiError::bad_request(code, msg).with_field("tenant_id");
        if let Some(t) = named {
            if !valid_tenant(t) {
                return Err(field(
                    "invalid",
                    &format!("tenant_id must be {TENANT_RULE}"),
                ));
            }
        }
        match (self.admin, named, self.tenant.as_deref()) {
            (true, Some(t), _) => Ok(t.to_string()),
            (true, None, Some(own)) => Ok(own.to_string()),
            (true, None, None) => Err(field(
                "required",
                "an admin token must name the tenant (tenant_id)",
            )),
            (false, Some(t), Some(own)) if t != own => Err(field(
                "tenant_not_allowed",
                "a tenant token acts for its own tenant only",
            )),
            (false, _, Some(own)) => Ok(own.to_string()),
            (false, _, None) => Err(ApiError::unauthorized(codes::UNAUTHORIZED, "invalid token")),
        }
    }
}

/// Why a token was refused (logged at debug, never sent).
#[derive(Debug, PartialEq, Eq)]
pub enum TokenError {
    Malformed,
    Algorithm,
    Signature,
    Expired,
    NoSubject,
}

/// Checks a token and returns its caller; `now_secs` is the injected clock's time.
pub fn verify(keys: &JwtKeys, token: &str, now_secs: i64) -> Result<Caller, TokenError> {
    if keys.secret.is_empty() || token.len() > MAX_TOKEN_BYTES {
        return Err(TokenError::Malformed);
    }
    let mut parts = token.split('.');
    let (Some(h), Some(c), Some(s), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(TokenError::Malformed);
    };
    let decode = |p: &str| URL_SAFE_NO_PAD.decode(p).map_err(|_| TokenError::Malformed);
    let header: Header = serde_json::from_slice(&decode(h)?).map_err(|_| TokenError::Malformed)?;
    if header.alg != "HS256" {
        return Err(TokenError::Algorithm);
    }
    let mut mac = keys.mac();
    mac.update(&token.as_bytes()[..h.len() + 1 + c.len()]);
    mac.verify_slice(&decode(s)?)
        .map_err(|_| TokenError::Signature)?;
    let claims: Claims = serde_json::from_slice(&decode(c)?).map_err(|_| TokenError::Malformed)?;
    if claims.exp <= now_secs {
        return Err(TokenError::Expired);
    }
    // A token's own tenant obeys the rule a named one does (a token minted past it, by hand or
    // by an earlier `token`, names no tenant the API would take).
    let tenant = claims.tenant_id.filter(|t| {
        let valid = valid_tenant(t);
        if !valid && !t.is_empty() {
            // The id itself may be what breaks the rule (too long, invisible characters): its
            // length only.
            tracing::warn!(
                tenant_bytes = t.len(),
                rule = TENANT_RULE,
                "a token names a tenant the API does not take: taken as naming none"
            );
        }
        valid
    });
    if tenant.is_none() && !claims.admin {
        return Err(TokenError::NoSubject);
    }
    Ok(Caller {
        tenant,
        admin: claims.admin,
    })
}

impl FromRequestParts<ApiState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &ApiState) -> Result<Caller, ApiError> {
        let refused =
            || ApiError::unauthorized(codes::UNAUTHORIZED, "a valid bearer token is required");
        let header = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .ok_or_else(refused)?;
        let value = header.to_str().map_err(|_| refused())?;
        // The scheme's name is case-insensitive (RFC 9110 §11.1).
        let token = value
            .split_once(' ')
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .ok_or_else(refused)?
            .1
            .trim();
        let now_secs = state.clock.now_ms().div_euclid(1000);
        verify(&state.jwt, token, now_secs).map_err(|e| {
            tracing::debug!(reason = ?e, "bearer token refused");
            match e {
                TokenError::Expired => {
                    ApiError::unauthorized(codes::TOKEN_EXPIRED, "the bearer token has expired")
                }
                _ => refused(),
            }
        })
    }
}

/// A caller with an admin token. The `/admin` handlers take it instead of a [`Caller`], so a
/// tenant token is refused (`403 admin_only`) before the path, query or body is even read.
#[derive(Debug, Clone)]
pub struct Admin(pub Caller);

impl FromRequestParts<ApiState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &ApiState) -> Result<Admin, ApiError> {
        let caller = Caller::from_request_parts(parts, state).await?;
        if !caller.admin {
            return Err(ApiError::new(
                axum::http::StatusCode::FORBIDDEN,
                "admin_only",
                "an admin token is required",
            ));
        }
        Ok(Admin(caller))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_750_000_000;

    fn keys() -> JwtKeys {
        JwtKeys::new(Secret::new("0123456789abcdef0123456789abcdef"))
    }

    #[test]
    fn a_named_tenant_with_whitespace_or_an_invisible_character_is_a_400_naming_tenant_id() {
        let admin = Caller {
            tenant: None,
            admin: true,
        };
        for bad in [
            "acme ",
            "\u{a0}acme",
            "acme\u{200b}",
            "acme\u{202e}1",
            "\u{feff}acme",
        ] {
            let e = admin.tenant_for(Some(bad)).unwrap_err();
            assert_eq!(
                (e.status.as_u16(), e.code.as_str(), e.field.as_deref()),
                (400, "invalid", Some("tenant_id")),
                "{bad:?}"
            );
            assert!(e.message.contains(TENANT_RULE), "{}", e.message);
        }
        assert_eq!(admin.tenant_for(Some("acme")).unwrap(), "acme");
    }

    #[test]
    fn a_lifetime_past_i64_seconds_mints_a_token_that_has_not_expired() {
        let t = mint_at(
            &keys().secret,
            Some("acme"),
            false,
            Duration::from_secs(1 << 63),
            NOW,
        );
        assert!(verify(&keys(), &t, NOW + 10).is_ok());
    }

    #[test]
    fn minted_token_verifies_with_its_claims() {
        let t = mint_at(
            &keys().secret,
            Some("acme"),
            false,
            Duration::from_secs(3600),
            NOW,
        );
        assert_eq!(
            verify(&keys(), &t, NOW + 10),
            Ok(Caller {
                tenant: Some("acme".into()),
                admin: false
            })
        );
        let a = mint_at(&keys().secret, None, true, Duration::from_secs(60), NOW);
        assert_eq!(
            verify(&keys(), &a, NOW),
            Ok(Caller {
                tenant: None,
                admin: true
            })
        );
    }

    #[test]
    fn a_token_whose_own_tenant_breaks_the_rule_names_none() {
        let long = "t".repeat(257);
        for bad in [
            "",
            "a\u{0}b",
            "line\nbreak",
            long.as_str(),
            " acme",
            "acme\u{a0}ltda",
            "acme\u{200b}",
            "\u{feff}acme",
            "acme\u{202e}1",
        ] {
            assert!(!valid_tenant(bad));
            let t = mint_at(
                &keys().secret,
                Some(bad),
                false,
                Duration::from_secs(60),
                NOW,
            );
            assert_eq!(
                verify(&keys(), &t, NOW),
                Err(TokenError::NoSubject),
                "{bad:?}"
            );
            let a = mint_at(
                &keys().secret,
                Some(bad),
                true,
                Duration::from_secs(60),
                NOW,
            );
            assert_eq!(verify(&keys(), &a, NOW).unwrap().tenant, None, "{bad:?}");
        }
        assert!(
            valid_tenant(&"t".repeat(256)) && valid_tenant("acme_ltda") && valid_tenant("租户")
        );
    }

    #[test]
    fn expired_token_is_refused_at_its_exp() {
        let t = mint_at(
            &keys().secret,
            Some("acme"),
            false,
            Duration::from_secs(60),
            NOW,
        );
        assert_eq!(verify(&keys(), &t, NOW + 60), Err(TokenError::Expired));
    }

    #[test]
    fn token_signed_with_another_secret_or_tampered_is_refused() {
        let other = Secret::new("another-secret-another-secret-xx");
        let t = mint_at(&other, Some("acme"), true, Duration::from_secs(60), NOW);
        assert_eq!(verify(&keys(), &t, NOW), Err(TokenError::Signature));
        let good = mint_at(
            &keys().secret,
            Some("acme"),
            false,
            Duration::from_secs(60),
            NOW,
        );
        let (head, rest) = good.split_once('.').unwrap();
        let (_, sig) = rest.split_once('.').unwrap();
        let forged_claims =
            URL_SAFE_NO_PAD.encode(br#"{"tenant_id":"acme","admin":true,"exp":9999999999}"#);
        assert_eq!(
            verify(&keys(), &format!("{head}.{forged_claims}.{sig}"), NOW),
            Err(TokenError::Signature)
        );
    }

    #[test]
    fn alg_none_and_other_algorithms_are_refused() {
        let claims = URL_SAFE_NO_PAD.encode(br#"{"tenant_id":"acme","exp":9999999999}"#);
        for alg in ["none", "HS512", "RS256", "hs256"] {
            let head = URL_SAFE_NO_PAD.encode(format!(r#"{{"alg":"{alg}"}}"#));
            assert_eq!(
                verify(&keys(), &format!("{head}.{claims}."), NOW),
                Err(TokenError::Algorithm),
                "{alg}"
            );
        }
        assert_eq!(
            verify(&keys(), "not-a-token", NOW),
            Err(TokenError::Malformed)
        );
    }

    #[test]
    fn empty_jwt_secret_refuses_every_token() {
        let t = mint_at(
            &Secret::new(""),
            Some("acme"),
            true,
            Duration::from_secs(60),
            NOW,
        );
        assert_eq!(
            verify(&JwtKeys::new(Secret::new("")), &t, NOW),
            Err(TokenError::Malformed)
        );
    }

    #[test]
    fn tenant_token_acts_for_itself_and_admin_must_name_a_tenant() {
        let tenant = Caller {
            tenant: Some("acme".into()),
            admin: false,
        };
        assert_eq!(tenant.tenant_for(None).unwrap(), "acme");
        assert_eq!(tenant.tenant_for(Some("acme")).unwrap(), "acme");
        assert_eq!(
            tenant
                .tenant_for(Some("other"))
                .unwrap_err()
                .field
                .as_deref(),
            Some("tenant_id")
        );
        let admin = Caller {
            tenant: None,
            admin: true,
        };
        assert_eq!(admin.tenant_for(Some("other")).unwrap(), "other");
        assert_eq!(admin.tenant_for(None).unwrap_err().code, "required");
        assert_eq!(admin.tenant_for(Some("")).unwrap_err().code, "invalid");
    }
}
