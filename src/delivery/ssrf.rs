//! The SSRF guard: webhook URLs must not reach private, loopback or link-local addresses unless
//! `STREAMING_HUB_ALLOW_PRIVATE_SINKS` (DESIGN.md §4).
//!
//! Two checks, because reqwest takes two paths to an address:
//! - [`check_url`] runs before every request (for deliveries once per URL string, kept by
//!   `client::CheckedUrls`: it looks nothing up, so its verdict never changes), and at validation
//!   time in the API. It refuses bad
//!   schemes, credentials in the URL, `localhost` names and forbidden IP literals. reqwest connects
//!   to an IP-literal host without asking the resolver, so this is the only check those get. The
//!   WHATWG parser normalises the other IPv4 notations (`2130706433`, `0177.0.0.1`, `0x7f.1`,
//!   `127.1`) to dotted quads and IPv6 literals to their canonical form before the check.
//! - [`GuardedResolver`] is the client's DNS resolver: it resolves with `tokio::net::lookup_host`
//!   (tests substitute a name service whose answers change, [`GuardedResolver::with_lookup`])
//!   and drops every forbidden address, failing when none is left. The connector dials only the
//!   addresses it returns, so the address checked is the address connected to: a name that
//!   resolves to a public address for one request and to 127.0.0.1 for the next (DNS rebinding)
//!   is refused at connect time. Host names are resolved only here, never when a subscription is
//!   written.
//!
//! Errors name what is wrong and the host; they never echo the whole URL (its path or query may
//! hold a token).
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;

use reqwest::Url;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};

/// Whether a destination address is refused (unless private sinks are allowed).
///
/// IPv4: `0.0.0.0/8` (unspecified included), `10/8`, `100.64/10` (CGNAT), `127/8`, `169.254/16`,
/// `172.16/12`, `192.0.0/24` (IETF protocol assignments), `192.0.2/24`, `198.51.100/24`,
/// `203.0.113/24` (documentation), `192.168/16`, `198.18/15` (benchmarking), `224/4` (multicast),
/// `240/4` (reserved, broadcast included), and `168.63.129.16`, a public address every Azure VM
/// reaches as its platform's agent endpoint (WireServer: what a metadata address is elsewhere).
/// IPv6: `::`, `::1`, `fc00::/7` (unique local), `fe80::/10` (link-local), `fec0::/10` (old
/// site-local), `ff00::/8` (multicast), `2001:db8::/32` (documentation), `100::/64` (discard),
/// `64:ff9b:1::/48` (local NAT64), and every IPv6 form that embeds an IPv4 address — mapped
/// `::ffff:a.b.c.d`, compatible `::a.b.c.d`, translated (SIIT) `::ffff:0:a.b.c.d`, NAT64
/// `64:ff9b::a.b.c.d`, 6to4 `2002:AABB:CCDD::` — when the embedded address is forbidden.
pub fn is_forbidden(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_forbidden_v4(v4),
        IpAddr::V6(v6) => is_forbidden_v6(v6),
    }
}

fn is_forbidden_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    a == 0
        || a == 10
        || (a == 100 && (b & 0xc0) == 64)
        || a == 127
        || (a == 169 && b == 254)
        || (a == 172 && (b & 0xf0) == 16)
        || (a == 192 && b == 0 && (c == 0 || c == 2))
        || (a == 192 && b == 168)
        || (a == 198 && (b & 0xfe) == 18)
        || (a == 198 && b == 51 && c == 100)
        || (a == 203 && b == 0 && c == 113)
        || a >= 224
        || ip == Ipv4Addr::new(168, 63, 129, 16)
}

fn is_forbidden_v6(ip: Ipv6Addr) -> bool {
    let s = ip.segments();
    let embedded_low = || Ipv4Addr::from(((s[6] as u32) << 16) | s[7] as u32);
    if ip.is_unspecified() || ip.is_loopback() {
        return true;
    }
    if let Some(v4) = ip.to_ipv4_mapped() {
        return is_forbidden_v4(v4);
    }
    if s[..6] == [0; 6] {
        // IPv4-compatible (deprecated, but some stacks still route it as IPv4).
        return is_forbidden_v4(embedded_low());
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] || s[..6] == [0, 0, 0, 0, 0xffff, 0] {
        // NAT64 well-known prefix; IPv4-translated (SIIT, RFC 2765).
        return is_forbidden_v4(embedded_low());
    }
    if s[0] == 0x2002 {
        return is_forbidden_v4(Ipv4Addr::from(((s[1] as u32) << 16) | s[2] as u32));
    }
    (s[0] & 0xfe00) == 0xfc00
        || (s[0] & 0xffc0) == 0xfe80
        || (s[0] & 0xffc0) == 0xfec0
        || (s[0] & 0xff00) == 0xff00
        || (s[0] == 0x2001 && s[1] == 0x0db8)
        // Teredo (2001::/32): a tunnel to the client's IPv4 address, carried inverted in the
        // last 32 bits; no server is reached through it. Benchmarking (2001:2::/48) and the
        // newer documentation range (3fff::/20) are special-use too.
        || (s[0] == 0x2001 && s[1] == 0)
        || (s[0] == 0x2001 && s[1] == 2 && s[2] == 0)
        || (s[0] == 0x3fff && (s[1] & 0xf000) == 0)
        || s[..4] == [0x100, 0, 0, 0]
        || (s[0] == 0x64 && s[1] == 0xff9b && s[2] == 1)
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    #[error("not a valid URL: {0}")]
    Parse(String),
    #[error("scheme `{0}` is not allowed: use https")]
    Scheme(String),
    #[error("http:// is refused: use https (or set STREAMING_HUB_ALLOW_INSECURE_SINKS=true)")]
    Insecure,
    #[error("URL has no host")]
    HostMissing,
    #[error("URL must not carry a user name or password")]
    Credentials,
    #[error(
        "host {0} is a private, loopback or link-local address \
         (allowed only with STREAMING_HUB_ALLOW_PRIVATE_SINKS=true)"
    )]
    PrivateAddress(String),
}

impl UrlError {
    /// A stable code for API error responses.
    pub fn code(&self) -> &'static str {
        match self {
            UrlError::Parse(_) => "url_invalid",
            UrlError::Scheme(_) => "url_scheme",
            UrlError::Insecure => "url_insecure",
            UrlError::HostMissing => "url_host_missing",
            UrlError::Credentials => "url_credentials",
            UrlError::PrivateAddress(_) => "url_private_address",
        }
    }
}

/// Parses and checks a webhook URL. Run before every request and when a subscription is written.
pub fn check_url(url: &str, allow_private: bool, allow_insecure: bool) -> Result<Url, UrlError> {
    let parsed = Url::parse(url.trim()).map_err(|e| UrlError::Parse(e.to_string()))?;
    match parsed.scheme() {
        "https" => {}
        "http" if allow_insecure => {}
        "http" => return Err(UrlError::Insecure),
        other => return Err(UrlError::Scheme(other.to_string())),
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(UrlError::Credentials);
    }
    let host = match parsed.host_str() {
        Some(host) if !host.is_empty() => host,
        _ => return Err(UrlError::HostMissing),
    };
    if !allow_private {
        // After parsing, a host that reads as an address is one (IPv6 in brackets); any other
        // host is a domain name.
        let literal = host.trim_start_matches('[').trim_end_matches(']');
        let refused = match literal.parse::<IpAddr>() {
            Ok(ip) => is_forbidden(ip),
            Err(_) => is_local_name(host),
        };
        if refused {
            return Err(UrlError::PrivateAddress(host.to_string()));
        }
    }
    Ok(parsed)
}

/// `localhost` and its subdomains (RFC 6761) always mean this machine, whatever DNS says.
fn is_local_name(name: &str) -> bool {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name == "localhost" || name.ends_with(".localhost")
}

/// Why the guarded resolver gave no address.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("resolving {host} failed: {reason}")]
    Lookup { host: String, reason: String },
    #[error(
        "every address of {host} is private, loopback or link-local \
         (allowed only with STREAMING_HUB_ALLOW_PRIVATE_SINKS=true)"
    )]
    Forbidden { host: String },
}

/// A name service: the addresses of a host name (port 0).
pub type Lookup =
    fn(String) -> Pin<Box<dyn Future<Output = std::io::Result<Vec<SocketAddr>>> + Send>>;

/// The system's name service, through tokio.
fn system_lookup(
    host: String,
) -> Pin<Box<dyn Future<Output = std::io::Result<Vec<SocketAddr>>> + Send>> {
    Box::pin(async move { Ok(tokio::net::lookup_host((host.as_str(), 0)).await?.collect()) })
}

/// The client's DNS resolver: tokio's resolver, minus forbidden addresses (see the module doc).
#[derive(Clone, Copy)]
pub struct GuardedResolver {
    allow_private: bool,
    lookup: Lookup,
}

impl std::fmt::Debug for GuardedResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuardedResolver")
            .field("allow_private", &self.allow_private)
            .finish_non_exhaustive()
    }
}

impl GuardedResolver {
    pub fn new(allow_private: bool) -> Self {
        GuardedResolver::with_lookup(allow_private, system_lookup)
    }

    /// The same guard over another name service (tests: one whose answers change between the
    /// check and the connection, as a rebinding attacker's DNS does).
    pub fn with_lookup(allow_private: bool, lookup: Lookup) -> Self {
        GuardedResolver {
            allow_private,
            lookup,
        }
    }

    /// The addresses a connection to `host` may use (port 0: the connector sets the URL's port).
    pub async fn lookup(&self, host: &str) -> Result<Vec<SocketAddr>, ResolveError> {
        let resolved = (self.lookup)(host.to_string())
            .await
            .map_err(|e| ResolveError::Lookup {
                host: host.to_string(),
                reason: e.to_string(),
            })?;
        let (allowed, refused): (Vec<SocketAddr>, Vec<SocketAddr>) = resolved
            .into_iter()
            .partition(|addr| self.allow_private || !is_forbidden(addr.ip()));
        if !refused.is_empty() {
            tracing::warn!(
                host,
                refused = refused.len(),
                kept = allowed.len(),
                "SSRF guard dropped private addresses of a webhook host"
            );
        }
        if allowed.is_empty() {
            return Err(if refused.is_empty() {
                ResolveError::Lookup {
                    host: host.to_string(),
                    reason: "no address".into(),
                }
            } else {
                ResolveError::Forbidden {
                    host: host.to_string(),
                }
            });
        }
        Ok(allowed)
    }
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let resolver = *self;
        let host = name.as_str().to_string();
        Box::pin(async move {
            let addrs = resolver.lookup(&host).await?;
            Ok(Box::new(addrs.into_iter()) as Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forbidden_address_table() {
        let forbidden = [
            "0.0.0.0",
            "0.1.2.3",
            "10.0.0.1",
            "10.255.255.255",
            "100.64.0.1",
            "100.127.255.254",
            "127.0.0.1",
            "127.8.9.10",
            "169.254.169.254",
            "168.63.129.16",
            "::ffff:168.63.129.16",
            "172.16.0.1",
            "172.31.255.255",
            "192.0.0.8",
            "192.0.2.1",
            "192.168.1.1",
            "198.18.0.1",
            "198.19.255.255",
            "198.51.100.7",
            "203.0.113.9",
            "224.0.0.1",
            "239.255.255.250",
            "240.0.0.1",
            "255.255.255.255",
            "::",
            "::1",
            "::ffff:127.0.0.1",
            "::ffff:10.1.2.3",
            "::ffff:169.254.169.254",
            "::127.0.0.1",
            "::10.0.0.1",
            "::169.254.169.254",
            "::ffff:0:127.0.0.1",
            "::ffff:0:10.9.8.7",
            "0:0:0:0:0:ffff:a9fe:a9fe",
            "64:ff9b::10.0.0.1",
            "64:ff9b:1::1",
            "2002:7f00:1::1",
            "2002:c0a8:101::",
            // Teredo (10.0.0.1 inside, inverted), benchmarking, documentation (3fff::/20).
            "2001:0:4136:e378:8000:63bf:f5ff:fffe",
            "2001:2::1",
            "3fff::1",
            "3fff:fff:ffff::1",
            "fc00::1",
            "fd00::1",
            "fdff:ffff::1",
            "fe80::1",
            "fe80::a00:27ff:fe4e:66a1",
            "febf::1",
            "fec0::1",
            "ff02::1",
            "2001:db8::1",
            "100::1",
        ];
        for text in forbidden {
            let ip: IpAddr = text.parse().unwrap();
            assert!(is_forbidden(ip), "{text} should be forbidden");
        }
        let allowed = [
            "1.1.1.1",
            "8.8.8.8",
            "9.255.255.255",
            "11.0.0.1",
            "100.63.255.255",
            "100.128.0.1",
            "126.255.255.255",
            "128.0.0.1",
            "169.253.1.1",
            "172.15.255.255",
            "172.32.0.1",
            "192.0.1.1",
            "192.167.1.1",
            "192.169.1.1",
            "198.17.1.1",
            "198.20.0.1",
            "223.255.255.255",
            "2606:4700:4700::1111",
            "2a00:1450:4001::200e",
            "::ffff:8.8.8.8",
            "::8.8.8.8",
            "::ffff:0:8.8.8.8",
            "64:ff9b::8.8.8.8",
            "2002:808:808::1",
            "2001:4860:4860::8888",
            "2001:3::1",
            "3ffe:1::1",
            "3fff:1000::1",
            "fbff::1",
            "fe00::1",
        ];
        for text in allowed {
            let ip: IpAddr = text.parse().unwrap();
            assert!(!is_forbidden(ip), "{text} should be allowed");
        }
    }

    /// Every notation of a private address, as a tenant could write it.
    const PRIVATE_URLS: &[&str] = &[
        "http://127.0.0.1/hook",
        "http://2130706433/",
        "http://0177.0.0.1/",
        "http://0x7f.0.0.1/",
        "http://0x7f000001/",
        "http://017700000001/",
        "http://127.1/",
        "http://0/",
        "http://10.0.0.1:8080/x",
        "http://0xa.0.0.1/",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]/",
        "http://[::ffff:127.0.0.1]/",
        "http://[::ffff:7f00:1]/",
        "http://[fd00::1]/",
        "http://[fc00::1]/",
        "http://[fdab:cdef:1234::1]/",
        "http://[fe80::1]/",
        "http://[fe80::a00:27ff:fe4e:66a1]/",
        "http://[::127.0.0.1]/",
        "http://[::7f00:1]/",
        "http://[::a00:1]/",
        "http://[0:0:0:0:0:ffff:a9fe:a9fe]/",
        "http://[::ffff:169.254.169.254]/",
        "http://[::ffff:0:7f00:1]/",
        "http://[64:ff9b::7f00:1]/",
        "http://3232235777/",
        "http://0300.0250.0001.0001/",
        "http://0xc0.0xa8.0x1.0x1/",
        "http://0xc0a80101/",
        "http://0xA9FEA9FE/",
        "http://2852039166/",
        "http://025177524776/",
        "http://169.254.169.254./",
        "http://10.1/",
        "http://0x7f.1/",
        "http://localhost/",
        "http://LOCALHOST./",
        "http://api.localhost:9000/",
    ];

    #[test]
    fn private_hosts_in_every_notation_are_refused() {
        for url in PRIVATE_URLS {
            match check_url(url, false, true) {
                Err(UrlError::PrivateAddress(_)) => {}
                other => panic!("{url}: expected PrivateAddress, got {other:?}"),
            }
        }
    }

    #[test]
    fn private_hosts_are_allowed_when_private_sinks_are_allowed() {
        for url in PRIVATE_URLS {
            assert!(check_url(url, true, true).is_ok(), "{url}");
        }
    }

    #[test]
    fn alternative_ipv4_notations_normalise_to_the_dotted_quad() {
        for url in ["http://2130706433/", "http://0177.0.0.1/", "http://0x7f.1/"] {
            let parsed = check_url(url, true, true).unwrap();
            assert_eq!(parsed.host_str(), Some("127.0.0.1"), "{url}");
        }
        // Decimal, octal and hex spellings of the cloud metadata and a 192.168 address.
        for url in [
            "http://2852039166/",
            "http://0251.0376.0251.0376/",
            "http://0xa9.0xfe.0xa9.0xfe/",
            "http://0xA9FEA9FE/",
            "http://169.16689662/",
        ] {
            let e = check_url(url, false, true).unwrap_err();
            assert_eq!(
                e,
                UrlError::PrivateAddress("169.254.169.254".into()),
                "{url}"
            );
        }
        for url in [
            "http://3232235777/",
            "http://0300.0250.1.1/",
            "http://0xc0a80101/",
        ] {
            let e = check_url(url, false, true).unwrap_err();
            assert_eq!(e, UrlError::PrivateAddress("192.168.1.1".into()), "{url}");
        }
        // An octal-looking public address is read as octal, as a browser would: 010.8.8.8 is 8.8.8.8.
        let parsed = check_url("http://010.8.8.8/", false, true).unwrap();
        assert_eq!(parsed.host_str(), Some("8.8.8.8"));
        let e = check_url("http://0x0a000001/", false, true).unwrap_err();
        assert_eq!(e, UrlError::PrivateAddress("10.0.0.1".into()));
    }

    #[test]
    fn ipv6_forms_embedding_a_private_ipv4_address_are_refused_in_urls() {
        for url in [
            "https://[::ffff:10.0.0.1]/",
            "https://[::ffff:a00:1]/",
            "https://[::10.0.0.1]/",
            "https://[::ffff:0:a00:1]/",
            "https://[64:ff9b::a00:1]/",
            "https://[2002:a00:1::1]/",
            "https://[2001:0:4136:e378:8000:63bf:f5ff:fffe]/",
        ] {
            assert!(
                matches!(
                    check_url(url, false, false),
                    Err(UrlError::PrivateAddress(_))
                ),
                "{url}"
            );
        }
        // A zone id (fe80::1%eth0) is not a URL host at all.
        assert!(check_url("http://[fe80::1%25eth0]/", false, true).is_err());
    }

    #[test]
    fn public_https_url_passes() {
        let url = check_url("https://hooks.example.com/in?x=1", false, false).unwrap();
        assert_eq!(url.host_str(), Some("hooks.example.com"));
        assert!(check_url("https://8.8.8.8/", false, false).is_ok());
        assert!(check_url("https://[2606:4700:4700::1111]/", false, false).is_ok());
    }

    #[test]
    fn http_needs_the_insecure_switch() {
        assert_eq!(
            check_url("http://hooks.example.com/", false, false),
            Err(UrlError::Insecure)
        );
        assert!(check_url("http://hooks.example.com/", false, true).is_ok());
    }

    #[test]
    fn each_url_error_names_what_is_wrong() {
        assert_eq!(
            check_url("ftp://example.com/", true, true),
            Err(UrlError::Scheme("ftp".into()))
        );
        assert_eq!(
            check_url("file:///etc/passwd", true, true),
            Err(UrlError::Scheme("file".into()))
        );
        assert_eq!(
            check_url("https://user:pw@example.com/", true, true),
            Err(UrlError::Credentials)
        );
        assert_eq!(
            check_url("https://user@example.com/", true, true),
            Err(UrlError::Credentials)
        );
        assert!(matches!(
            check_url("not a url", true, true),
            Err(UrlError::Parse(_))
        ));
        assert!(matches!(
            check_url("https://", true, true),
            Err(UrlError::Parse(_) | UrlError::HostMissing)
        ));
        let codes = [
            UrlError::Parse(String::new()).code(),
            UrlError::Scheme(String::new()).code(),
            UrlError::Insecure.code(),
            UrlError::HostMissing.code(),
            UrlError::Credentials.code(),
            UrlError::PrivateAddress(String::new()).code(),
        ];
        let mut unique = codes.to_vec();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), codes.len());
    }

    #[test]
    fn url_error_does_not_echo_path_query_or_password() {
        let e = check_url("https://u:hunter2@example.com/?token=abc", true, true).unwrap_err();
        assert!(!e.to_string().contains("hunter2"));
        let e = check_url("http://10.0.0.1/?token=abc", false, true).unwrap_err();
        assert!(!e.to_string().contains("token"), "{e}");
    }

    #[tokio::test]
    async fn guarded_resolver_refuses_localhost_when_private_is_not_allowed() {
        let e = GuardedResolver::new(false)
            .lookup("localhost")
            .await
            .unwrap_err();
        assert!(matches!(e, ResolveError::Forbidden { .. }), "{e}");
    }

    #[tokio::test]
    async fn guarded_resolver_returns_localhost_when_private_is_allowed() {
        let addrs = GuardedResolver::new(true)
            .lookup("localhost")
            .await
            .unwrap();
        assert!(!addrs.is_empty());
        assert!(addrs.iter().all(|a| a.ip().is_loopback()), "{addrs:?}");
    }

    #[tokio::test]
    async fn guarded_resolver_filters_literal_names_too() {
        let e = GuardedResolver::new(false)
            .lookup("127.0.0.1")
            .await
            .unwrap_err();
        assert!(matches!(e, ResolveError::Forbidden { .. }), "{e}");
        let addrs = GuardedResolver::new(false).lookup("8.8.8.8").await.unwrap();
        assert_eq!(addrs[0].ip(), "8.8.8.8".parse::<IpAddr>().unwrap());
    }
}
